"""A fourth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` /
``vmap(jacrev)`` and per-example loops). The first three sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more` and :mod:`test_peer_suites_third`; this one adds the projects that
*use* per-example gradients rather than compute them:

- Captum (``tests/utils/test_sample_gradient.py``, ``tests/utils/test_jacobian.py``,
  ``tests/influence/``): ``SampleGradientWrapper`` on its basic models (two inputs, a module
  with two outputs, in-place ReLUs, a padded and dilated convolution), per-sample gradients of
  chosen layers only, ``_compute_jacobian_wrt_params`` with and without the sample-wise trick
  (no loss, ``MSELoss`` with ``reduction`` none / sum / mean, a custom loss), and TracIn's
  scores: ``TracInCP`` (gradient dot products over checkpoints, self-influence) and
  ``TracInCPFast`` (the last layer's gradients as an outer product);
- laplace-torch (``tests/test_jacobians.py``, ``tests/test_curv_backends_*.py``,
  ``tests/test_baselaplace.py``): its backends' ``jacobians(x)`` ``[batch, outputs, params]``
  (a linear model's are its inputs), last-layer Jacobians, ``functional_variance``, the full
  and diagonal GGN and empirical Fisher, ``gradients(x, y)``, and Kronecker factors exact for
  one example and growing with repeated examples; Jacobians and factors taken under
  ``torch.no_grad()`` (its predictive), and its ``enable_backprop`` Jacobians refused;
- Opacus (``grad_sample_module_fast_gradient_clipping_test.py``,
  ``per_sample_gradient_clip_test.py``, ``batch_memory_manager_test.py``,
  ``poisson_test.py``, ``virtual_step_test.py``): ghost norms against the materialized ones
  and the clipped gradient against the per-example loop's on Linear / Conv / Embedding /
  LayerNorm / GroupNorm models, flat clipping of its conv-to-conv1d network, physical batches
  of a Poisson batch, the sampler's inclusion rate and seeding, the noise drawn once per
  logical batch;
- private-vision (mixed ghost clipping of CNNs: each layer's norm by the cheaper of the Gram
  and the materialized forms, on depthwise, grouped, padded, 3-d and transposed convolutions)
  and pyvacy (DP-SGD as a per-example loop, with its noise, its expected batch size and its
  micro-batches); Opacus' Embedding and EmbeddingBag variants by every clipping method;
- data attribution: TRAK (per-example gradients of the margin, randomly projected, at
  checkpoint weights given to ``functional_call``, of a causal language model, and its
  scores), torch-influence (``-∇L_testᵀ H⁻¹ ∇ℓ_i``, checked against re-training with the
  example up-weighted; gradients of chosen parameters; Hessian-vector products by double
  backward), and the gradient noise scale of McCandlish et al. (``B_simple`` from per-example
  norms and the batch gradient, per layer from ``grad_variance``, under bfloat16 autocast).

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap
from torch.utils.data import TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import as_double, assert_close, assert_grad1, seeded

D = torch.float64


# -- shared functions ---------------------------------------------------------------------------


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def flat_grad1(model: nn.Module) -> Tensor:
    """``[batch, P]``: every trainable parameter's ``grad1``, flattened and concatenated."""
    return torch.cat([p.grad1.flatten(1) for p in trainable(model).values()], 1)


def flat_oracle(want: dict[str, Tensor], model: nn.Module) -> Tensor:
    """``[batch, P]`` of an oracle's ``{name: [batch, *p.shape]}``, in the same order."""
    return torch.cat([want[n].flatten(1) for n in trainable(model)], 1)


def jacobians_by_jacrev(model: nn.Module, x: Tensor) -> Tensor:
    """``[batch, outputs, P]``: each example's Jacobian of its flattened output with respect to
    every trainable parameter, by ``vmap(jacrev)`` of a batch of one, parameters concatenated
    in ``named_parameters()`` order."""
    params = {n: p.detach() for n, p in trainable(model).items()}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update(dict(model.named_buffers()))

    def one(p, xi):
        return functional_call(model, (p, rest), (xi.unsqueeze(0),)).reshape(-1)

    with gradhooks.paused():
        jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    return torch.cat([jac[n].flatten(2) for n in params], 2)


def oracle_clipped(want: dict[str, Tensor], max_norm: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-example norms of the whole model's gradient and, per parameter, the sum of the
    examples' gradients clipped to ``max_norm`` (DP-SGD's clipping, from the oracle's)."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    factors = torch.where(norms > max_norm, max_norm / norms, torch.ones_like(norms))
    sums = {n: torch.einsum("b,b...->...", factors, g) for n, g in want.items()}
    return norms, sums


def param_norms_of(want: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: g.flatten(1).norm(dim=1) for n, g in want.items()}


# == Captum: SampleGradientWrapper (tests/utils/test_sample_gradient.py) =========================
# Its basic models (its tests' basic_models.py), rewritten: fixed weights that put many of the
# ReLUs at zero, large inputs, optional in-place ReLUs.


class MultiRelu(nn.Module):
    """Two ReLUs in one module, two inputs and two outputs (Captum's ``MultiRelu``)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.relu1, self.relu2 = nn.ReLU(inplace=inplace), nn.ReLU(inplace=inplace)

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return self.relu1(a), self.relu2(b)


class CaptumMultiLayer(nn.Module):
    """Captum's ``BasicModel_MultiLayer(multi_input_module=True)``: an identity Linear, two
    Linear branches (one of the input, one of the first's output) through a two-output module,
    summed, then a Linear; ``forward(x, add_input=None)``."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.linear0 = nn.Linear(3, 3)
        self.linear1, self.linear1_alt = nn.Linear(3, 4), nn.Linear(3, 4)
        self.multi_relu = MultiRelu(inplace)
        self.linear2 = nn.Linear(4, 2)
        with torch.no_grad():
            self.linear0.weight.copy_(torch.eye(3))
            self.linear0.bias.zero_()
            for lin in (self.linear1, self.linear1_alt):
                lin.weight.fill_(1.0)
                lin.bias.copy_(torch.tensor([-10.0, 1.0, 1.0, 1.0]))
            self.linear2.weight.fill_(1.0)
            self.linear2.bias.copy_(torch.tensor([-1.0, 1.0]))

    def forward(self, x: Tensor, add_input: Tensor | None = None) -> Tensor:
        inp = x if add_input is None else x + add_input
        a, b = self.multi_relu(self.linear1(self.linear0(inp)), self.linear1_alt(inp))
        return self.linear2(a + b)


class CaptumOneConv(nn.Module):
    """Captum's ``BasicModel_ConvNet_One_Conv``: Conv2d(1, 2, 3) with biases -50 and -75, a
    ReLU, the ``[batch, 8]`` view, a Linear and a ReLU; ``forward(x, x2=None)``."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.conv1, self.fc1 = nn.Conv2d(1, 2, 3, 1), nn.Linear(8, 4)
        self.relu1, self.relu2 = nn.ReLU(inplace=inplace), nn.ReLU(inplace=inplace)
        with torch.no_grad():
            self.conv1.weight.fill_(1.0)
            self.conv1.bias.copy_(torch.tensor([-50.0, -75.0]))
            self.fc1.weight.copy_(torch.cat([torch.ones(4, 5), -torch.ones(4, 3)], 1))
            self.fc1.bias.zero_()

    def forward(self, x: Tensor, x2: Tensor | None = None) -> Tensor:
        x = x if x2 is None else x + x2
        return self.relu2(self.fc1(self.relu1(self.conv1(x)).view(-1, 8)))


class CaptumPaddingDilation(nn.Module):
    """Captum's ``BasicModel_ConvNetWithPaddingDilation``: a padded, strided, dilated Conv2d,
    then a Linear over each channel's 16 positions (a Linear on ``[batch, 2, 16]``)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=3, stride=2, dilation=2)
        self.relu1, self.fc1 = nn.ReLU(inplace=inplace), nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        return self.fc1(self.relu1(self.conv1(x)).reshape(b, 2, -1)).reshape(b, -1)


CAPTUM_SAMPLE_GRADS = {
    # id: (model class, inputs of a batch of 6, "sum" or "mean")
    "linear_sum": (CaptumMultiLayer, lambda: (torch.randn(6, 3), torch.randn(6, 3)), "sum"),
    "linear_mean": (CaptumMultiLayer, lambda: (20 * torch.randn(6, 3),), "mean"),
    "conv_sum": (CaptumOneConv, lambda: (123 * torch.randn(6, 1, 4, 4),), "sum"),
    "conv_mean_multi_inp": (
        CaptumOneConv,
        lambda: (20 * torch.randn(6, 1, 4, 4), 9 * torch.randn(6, 1, 4, 4)),
        "mean",
    ),  # fmt: skip
    "modified_conv_mean": (CaptumPaddingDilation, lambda: (20 * torch.randn(6, 1, 5, 5),), "mean"),
    "modified_conv_sum": (CaptumPaddingDilation, lambda: (20 * torch.randn(6, 1, 5, 5),), "sum"),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["relu", "inplace_relu"])
@pytest.mark.parametrize("case", list(CAPTUM_SAMPLE_GRADS))
def test_captum_sample_gradients_match_the_per_example_loop(case, inplace):
    """``SampleGradientWrapper.compute_param_sample_gradients(loss_fn(out), loss_type)`` with
    ``loss_fn`` the sum or the mean of the whole output, against one backward per example
    (Captum's ``test_sample_grads_*``): ``grad1`` under ``loss_reduction=loss_type``, every
    parameter, with in-place ReLUs too (Captum's models take ``inplace=``)."""
    factory, inputs, reduction = CAPTUM_SAMPLE_GRADS[case]
    model = seeded(lambda: factory(inplace)).double()
    xs = tuple(as_double(t) for t in seeded(inputs, seed=1))
    loss = (lambda out: out.sum()) if reduction == "sum" else (lambda out: out.mean())
    want = vmap_grad(model, loss, xs)
    by_loop = loop_grad(model, loss, xs)
    for n in want:
        assert_close(by_loop[n], want[n], f"{case}: loop vs vmap, {n}")
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        loss(model(*xs)).backward()
    assert_grad1(model, want, f"{case} ({reduction}, inplace={inplace})")
    for n, p in trainable(model).items():
        reduced = p.grad1.sum(0) if reduction == "sum" else p.grad1.mean(0)
        assert_close(reduced, p.grad, f"{case}: grad1 reduced vs .grad, {n}")


@pytest.mark.parametrize("layers", ["conv1", "fc1", "conv1,fc1"])
def test_captum_sample_gradients_of_chosen_layers_only(layers):
    """``SampleGradientWrapper(model, layer_modules)``: only the chosen layers' parameters get
    per-sample gradients (Captum's ``test_sample_grads_layer_modules``). Here: hooks on the
    chosen submodule (or the whole model); the others get no ``grad1`` and their ``.grad`` is
    autograd's as usual."""
    model = seeded(CaptumOneConv).double()
    x = tuple(
        as_double(t)
        for t in seeded(lambda: (20 * torch.randn(6, 1, 4, 4), 9 * torch.randn(6, 1, 4, 4)), 1)
    )
    loss = lambda out: out.sum()  # noqa: E731
    want = vmap_grad(model, loss, x)
    chosen = layers.split(",")
    target = model if len(chosen) == 2 else getattr(model, chosen[0])
    with gradhooks.add_hooks(target, loss_reduction="sum"):
        loss(model(*x)).backward()
    for n, p in model.named_parameters():
        if n.split(".")[0] in chosen:
            assert_close(p.grad1, want[n], f"{layers}: {n}")
        else:
            assert not hasattr(p, "grad1"), f"{layers}: {n} is not chosen but got a grad1"
            assert_close(p.grad, want[n].sum(0), f"{layers}: .grad of {n}")


# == Captum: _compute_jacobian_wrt_params (tests/utils/test_jacobian.py) =========================


class CaptumLinear(nn.Module):
    """Captum's ``BasicLinearModel2(5, out)``: one Linear without bias, weight ``arange``."""

    def __init__(self, out: int):
        super().__init__()
        self.linear = nn.Linear(5, out, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.arange(5.0 * out).view(out, 5))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class CaptumLinearMultilayer(nn.Module):
    """Captum's ``BasicLinearModel_Multilayer(5, 2, out)``: two Linears without bias."""

    def __init__(self, out: int):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(5, 2, bias=False), nn.Linear(2, out, bias=False)
        with torch.no_grad():
            self.linear1.weight.copy_(torch.arange(10.0).view(2, 5))
            self.linear2.weight.copy_(torch.arange(1.0, 1.0 + 2 * out).view(out, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.linear1(x))


def _no_loss(out, label=None):
    return out.sum()


def _mse_none(out, label):
    return F.mse_loss(out, label, reduction="none").sum()


def _mse_sum(out, label):
    return F.mse_loss(out, label, reduction="sum")


def _mse_mean(out, label):
    return F.mse_loss(out, label, reduction="mean")


def _custom(out, label):
    return (out - label).pow(2).sum()


CAPTUM_JACOBIAN_LOSSES = {
    # id: (the loss of a batch, which grad1 is of: "sum" or "mean")
    "scores": (_no_loss, "sum"),  # no loss: the gradient of each example's summed output
    "mse_none": (_mse_none, "sum"),
    "mse_sum_sample_wise": (_mse_sum, "sum"),
    "mse_mean_sample_wise": (_mse_mean, "mean"),
    "custom": (_custom, "sum"),
}


@pytest.mark.parametrize("loss", list(CAPTUM_JACOBIAN_LOSSES))
@pytest.mark.parametrize(
    "model", ["linear_1", "linear_2", "multilayer_1", "multilayer_2"]
)  # fmt: skip
def test_captum_jacobian_wrt_params(model, loss):
    """``_compute_jacobian_wrt_params`` and ``..._with_sample_wise_trick`` (Captum's
    ``test_jacobian_scores_*`` and ``test_jacobian_loss_*``): per example, the gradient of its
    output summed (no loss) or of its loss (``MSELoss`` with ``reduction`` none, sum or mean,
    a custom loss), for Captum's linear models with scalar and vector outputs, on its batch
    ``[ones, 2·ones]``. Against the loop, and for a single Linear against the closed form
    ``∂ℓ/∂out ⊗ x``."""
    kind, out = model.rsplit("_", 1)
    net = (CaptumLinear if kind == "linear" else CaptumLinearMultilayer)(int(out)).double()
    x = torch.stack([torch.ones(5), 2 * torch.ones(5)]).double()
    label = seeded(lambda: 10 * torch.randn(2, int(out)), 1).double()
    loss_fn, reduction = CAPTUM_JACOBIAN_LOSSES[loss]
    want = loop_grad(net, loss_fn, x, label)
    with gradhooks.add_hooks(net, loss_reduction=reduction):
        batch_loss = loss_fn(net(x), label)
        batch_loss.backward()
    assert_grad1(net, want, f"{model}, {loss}")
    if kind == "linear":
        with torch.enable_grad():
            o = net(x).detach().requires_grad_()
            own = [loss_fn(o[i : i + 1], label[i : i + 1]) for i in range(2)]
            dout = torch.cat([torch.autograd.grad(v, o)[0][i : i + 1] for i, v in enumerate(own)])
        closed = torch.einsum("bo,bi->boi", dout, x)
        assert_close(net.linear.weight.grad1, closed, f"{model}, {loss}: closed form")


@pytest.mark.parametrize("losses", ["scalar", "per_output"])
def test_captum_loss_without_one_value_per_example_is_refused(losses):
    """A loss that is not one value per example where per-example losses are needed (Captum's
    ``test_jacobian_loss_custom_wrong`` and ``..._wrong_reduction_sample_wise_trick``): a
    scalar, or ``MSELoss(reduction="none")``'s ``[batch, outputs]``, given to
    :func:`gradhooks.dp_sgd_step` is refused with an error that says what to give, and no
    gradient is written."""
    net = CaptumLinear(2).double()
    x = torch.stack([torch.ones(5), 2 * torch.ones(5)]).double()
    label = torch.tensor([[9.0, 38.0], [18.0, 74.0]], dtype=D)
    with gradhooks.add_hooks(net, quantities=("norms",)) as h:
        per = F.mse_loss(net(x), label, reduction="none")
        bad = per.sum() if losses == "scalar" else per
        with pytest.raises(gradhooks.ConfigurationError, match="per_example_loss must be"):
            gradhooks.dp_sgd_step(h, bad, max_norm=1.0, noise_multiplier=0.0)
    assert net.linear.weight.grad is None


# == Captum: TracIn (captum/influence/_core/tracincp.py, tracincp_fast_rand_proj.py) =============


def classifier() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def conv_classifier() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(16, 3),
    )  # fmt: skip


def classification_data(model_kind: str, batch: int, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(batch, 4) if model_kind == "mlp" else torch.randn(batch, 1, 7, 7)
    return x.double(), torch.randint(3, (batch,))


def checkpoints(factory, count: int = 2) -> list[nn.Module]:
    """``count`` float64 models along a pretend training run (TracIn's checkpoints)."""
    first = seeded(factory).double()
    out = [first]
    for k in range(1, count):
        nxt = copy.deepcopy(out[-1])
        with torch.no_grad():
            for p in nxt.parameters():
                p.add_(
                    0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k), dtype=D)
                )
        out.append(nxt)
    return out


def ce_sum(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def hooked_grads(model, x, y, reduction: str = "sum") -> Tensor:
    """``[batch, P]``: the per-example gradients of the cross-entropy by gradhooks."""
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        F.cross_entropy(model(x), y, reduction=reduction).backward()
    g = flat_grad1(model)
    gradhooks.clear_grad1(model)
    model.zero_grad()
    return g


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_tracin_scores_are_gradient_dot_products_over_checkpoints(kind, reduction):
    """``TracInCP.influence((x_test, y_test))``: ``Σ_k lr_k ⟨∇ℓ(z_test; θ_k), ∇ℓ(z_i; θ_k)⟩``
    for every test and training example (Captum's ``tests/influence/_core/test_tracin_*``,
    whose ``sample_wise_grads_per_batch=True`` path takes the per-example gradients from its
    hooks, with a ``reduction`` ``"sum"`` or ``"mean"`` loss)."""
    ckpts = checkpoints(classifier if kind == "mlp" else conv_classifier)
    lrs = [0.5, 0.25]
    x, y = classification_data(kind, 8, 1)
    xt, yt = classification_data(kind, 3, 2)
    got = sum(
        lr * hooked_grads(m, xt, yt, reduction) @ hooked_grads(m, x, y, reduction).T
        for lr, m in zip(lrs, ckpts)
    )
    want = sum(
        lr
        * flat_oracle(vmap_grad(m, ce_sum, xt, yt), m)
        @ flat_oracle(vmap_grad(m, ce_sum, x, y), m).T
        for lr, m in zip(lrs, ckpts)
    )
    assert_close(got, want, f"TracIn scores ({kind}, {reduction})")


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_tracin_self_influence_from_per_example_norms(kind):
    """``TracInCP.self_influence``: ``Σ_k lr_k ‖∇ℓ(z_i; θ_k)‖²``, from ghost norms
    (``quantities=("norms",)``, never forming the gradients), against the oracle's."""
    ckpts = checkpoints(classifier if kind == "mlp" else conv_classifier)
    lrs = [0.5, 0.25]
    x, y = classification_data(kind, 8, 1)
    got = torch.zeros(8, dtype=D)
    for lr, m in zip(lrs, ckpts):
        with gradhooks.add_hooks(m, quantities=("norms",)) as h:
            F.cross_entropy(m(x), y).backward()
            got += lr * h.norms() ** 2
    want = sum(
        lr * flat_oracle(vmap_grad(m, ce_sum, x, y), m).pow(2).sum(1) for lr, m in zip(lrs, ckpts)
    )
    assert_close(got, want, f"self-influence ({kind})")


class PenultimateAndHead(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 3, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_tracin_cp_fast_last_layer_gradients_are_outer_products(bias):
    """``TracInCPFast(final_fc_layer=...)``: the final Linear's per-example gradient is
    ``∂ℓ/∂out ⊗ a`` (``a`` its input), so a score is ``⟨e_t, e_i⟩·(⟨a_t, a_i⟩ + 1[bias])``
    (Captum's ``_basic_computation_tracincp_fast``). The head's ``grad1`` (hooks on the head
    only) against the oracle and against that product of the captured activations and
    output-gradients."""
    model = seeded(lambda: PenultimateAndHead(bias)).double()
    x, y = classification_data("mlp", 8, 1)
    with gradhooks.add_hooks(model.head, loss_reduction="sum", keep_backprops=True) as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        a, (e,) = h.activations(model.head), h.backprops(model.head)
    want = vmap_grad(model, ce_sum, x, y)
    assert_close(model.head.weight.grad1, want["head.weight"], "head.weight")
    scores = model.head.weight.grad1.flatten(1) @ model.head.weight.grad1.flatten(1).T
    factored = (e @ e.T) * (a @ a.T)
    if bias:
        assert_close(model.head.bias.grad1, want["head.bias"], "head.bias")
        scores = scores + model.head.bias.grad1 @ model.head.bias.grad1.T
        factored = (e @ e.T) * (a @ a.T + 1)
    assert_close(scores, factored, "TracInCPFast's factored scores")
    assert not hasattr(model.body[0].weight, "grad1")


# == laplace-torch: its backends' Jacobians and curvature (tests/test_jacobians.py, ...) =========


def laplace_model(outputs: int, tanh: bool = False) -> nn.Sequential:
    middle = [nn.Tanh()] if tanh else []
    return seeded(
        lambda: nn.Sequential(nn.Linear(3, 20), *middle, nn.Linear(20, outputs)), 711
    ).double()


def laplace_x(batch: int = 200) -> Tensor:
    return seeded(lambda: torch.randn(batch, 3), 15).double()


def test_laplace_jacobians_of_a_linear_model_are_its_inputs():
    """``backend.jacobians(X)`` of ``Linear(3, 1, bias=False)`` is ``X`` as
    ``[batch, 1, 3]`` (laplace's ``test_linear_jacobians``), exactly."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 1, bias=False))).double()
    x = laplace_x()
    J = gradhooks.jacobians(model, x, flatten=True)
    assert J.shape == (200, 1, 3)
    assert torch.equal(J, x.reshape(200, 1, -1))


@pytest.mark.parametrize("net", ["singleoutput", "multioutput", "tanh_multioutput"])
def test_laplace_jacobians_against_jacrev(net):
    """``Js, f = backend.jacobians(X)``, ``[batch, outputs, params]``, against its
    ``jacobians_naive`` (laplace's ``test_jacobians_singleoutput`` / ``_multioutput``; the
    tanh network of ``test_curv_backends_*``), 200 examples."""
    model = laplace_model(1 if net == "singleoutput" else 2, tanh=net.startswith("tanh"))
    x = laplace_x()
    J = gradhooks.jacobians(model, x, flatten=True)
    assert J.shape == (200, model[-1].out_features, sum(p.numel() for p in model.parameters()))
    assert_close(J, jacobians_by_jacrev(model, x), net)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_laplace_jacobians_and_kron_under_no_grad(mode):
    """laplace's predictive is evaluated under ``torch.no_grad()`` (its backends take the
    Jacobians under ``torch.enable_grad()`` inside: ``BaseLaplace._glm_predictive_distribution``,
    ``test_baselaplace.py``'s predictive tests). :func:`gradhooks.jacobians` and
    :func:`gradhooks.kfac` called under ``torch.no_grad()`` or ``torch.inference_mode()`` give
    the same numbers as outside (not zeros from a forward that recorded nothing)."""
    model = laplace_model(2, tanh=True)
    x = laplace_x(20)
    y = laplace_targets("classification", 20)
    want = jacobians_by_jacrev(model, x)
    outside = gradhooks.kfac(model, x, y, fisher="exact")
    with getattr(torch, mode)():
        J = gradhooks.jacobians(model, x, flatten=True)
        inside = gradhooks.kfac(model, x, y, fisher="exact")
    assert_close(J, want, f"jacobians under {mode}")
    for name, f in outside.items():
        assert_close(inside[name].A, f.A, f"{name}: A under {mode}")
        assert_close(inside[name].G, f.G, f"{name}: G under {mode}")


@pytest.mark.parametrize("outputs", [1, 2])
def test_laplace_backprop_jacobians_are_refused_not_detached(outputs):
    """laplace's ``backend.jacobians(X, enable_backprop=True)`` (``test_backprop_jacobians_*``):
    Jacobians that a loss can be differentiated through, with respect to ``X``. gradhooks'
    Jacobians are values without autograd history, so an input that requires grad is refused
    (:class:`gradhooks.UnsupportedInputError`, naming ``torch.func``) rather than answered with
    Jacobians whose contribution to a loss's gradient would silently be zero; detached, or
    under ``torch.no_grad()``, the same input gives the values."""
    model = laplace_model(outputs)
    x = laplace_x(30).requires_grad_()
    with pytest.raises(gradhooks.UnsupportedInputError, match="torch.func"):
        gradhooks.jacobians(model, x)
    want = jacobians_by_jacrev(model, x.detach())
    assert_close(gradhooks.jacobians(model, x.detach(), flatten=True), want, "detached")
    with torch.no_grad():
        assert_close(gradhooks.jacobians(model, x, flatten=True), want, "under no_grad")


@pytest.mark.parametrize("outputs", [1, 2])
def test_laplace_last_layer_jacobians(outputs):
    """``backend.last_layer_jacobians(X)`` (laplace's ``FeatureExtractor`` and
    ``test_last_layer_jacobians_*``): the Jacobians of the last layer at the features ``phi``,
    two ways (the last layer on ``phi``; the whole model with the body frozen), against
    ``jacrev``."""
    model = laplace_model(outputs, tanh=True)
    x = laplace_x(50)
    phi = model[:-1](x).detach()
    on_phi = gradhooks.jacobians(model[-1], phi, flatten=True)
    for p in model[:-1].parameters():
        p.requires_grad_(False)
    frozen_body = gradhooks.jacobians(model, x, flatten=True)
    want = jacobians_by_jacrev(model[-1], phi)
    eye = torch.eye(outputs, dtype=D).expand(50, -1, -1)
    closed = torch.cat([torch.einsum("bco,bi->bcoi", eye, phi).flatten(2), eye], 2)
    assert_close(want, closed, "jacrev vs the closed form [δ ⊗ phi, δ]")
    assert_close(on_phi, want, "last layer on phi")
    assert_close(frozen_body, want, "whole model, body frozen")


@pytest.mark.parametrize("posterior", ["diag", "full"])
def test_laplace_functional_variance(posterior):
    """``functional_variance(Js)`` of the GLM predictive, ``Jᵦ Σ Jᵦᵀ`` per example
    (``[batch, outputs, outputs]``), for a diagonal and a full posterior covariance (laplace's
    ``test_baselaplace.py`` ``test_functional_variance*``), from gradhooks' Jacobians against
    ``jacrev``'s."""
    model = laplace_model(2, tanh=True)
    x = laplace_x(40)
    P = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(3)
    if posterior == "diag":
        cov = torch.diag(torch.rand(P, generator=g, dtype=D) + 0.1)
    else:
        L = torch.randn(P, P, generator=g, dtype=D) / math.sqrt(P)
        cov = L @ L.T + 0.1 * torch.eye(P, dtype=D)
    J = gradhooks.jacobians(model, x, flatten=True)
    Jw = jacobians_by_jacrev(model, x)
    got = torch.einsum("ncp,pq,nkq->nck", J, cov, J)
    want = torch.einsum("ncp,pq,nkq->nck", Jw, cov, Jw)
    assert_close(got, want, f"functional variance ({posterior})")
    assert (torch.diagonal(got, dim1=1, dim2=2) > 0).all()


def output_hessian(out: Tensor, likelihood: str) -> Tensor:
    """``[batch, C, C]``: the Hessian of each example's loss with respect to its output: the
    identity for ``0.5·‖f - y‖²``, ``diag(p) - p pᵀ`` for the cross-entropy."""
    if likelihood == "regression":
        return torch.eye(out.shape[1], dtype=out.dtype).expand(out.shape[0], -1, -1)
    p = out.softmax(1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def laplace_targets(likelihood: str, batch: int) -> Tensor:
    torch.manual_seed(711)
    return (
        torch.randn(batch, 2, dtype=D) if likelihood == "regression" else torch.randint(2, (batch,))
    )


def laplace_loss(likelihood: str):
    if likelihood == "regression":
        return lambda out, y: 0.5 * (out - y).pow(2).sum()
    return ce_sum


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_laplace_full_and_diagonal_ggn(likelihood):
    """``BackPackGGN(stochastic=False).full(X, y)`` and ``.diag(X, y)``: the GGN
    ``Σᵦ Jᵦᵀ Λᵦ Jᵦ`` (``Λ`` the loss Hessian with respect to the output) from the per-example
    Jacobians, its diagonal the ``diag`` backend's (laplace's ``test_diag_ggn_*_backpack``)."""
    model = laplace_model(2, tanh=True)
    x = seeded(lambda: torch.randn(10, 3), 711).double()
    lam = output_hessian(model(x).detach(), likelihood)
    J = gradhooks.jacobians(model, x, flatten=True)
    ggn = torch.einsum("ncp,ncd,ndq->pq", J, lam, J)
    Jw = jacobians_by_jacrev(model, x)
    want = torch.einsum("ncp,ncd,ndq->pq", Jw, lam, Jw)
    assert_close(ggn, want, f"GGN ({likelihood})")
    diag = torch.einsum("ncp,ncd,ndp->p", J, lam, J)
    assert_close(diag, want.diagonal(), f"diag GGN ({likelihood})")


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_laplace_gradients_and_empirical_fisher(likelihood):
    """``backend.gradients(X, y)`` (``[batch, params]`` and the summed loss) and
    ``BackPackEF.full`` / ``.diag`` (laplace's ``test_full_vs_diag_ef_*``): the empirical
    Fisher ``Σᵢ gᵢ gᵢᵀ`` from ``grad1``, its diagonal from ``quantities=("sum_grad_sq",)``."""
    model = laplace_model(2, tanh=True)
    x = seeded(lambda: torch.randn(10, 3), 711).double()
    y = laplace_targets(likelihood, 10)
    loss = laplace_loss(likelihood)
    want = flat_oracle(vmap_grad(model, loss, x, y), model)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "sum_grad_sq")) as h:
        value = loss(model(x), y)
        value.backward()
        G = flat_grad1(model)
        diag = torch.cat([h.sum_grad_sq()[n].flatten() for n in trainable(model)])
    assert_close(G, want, f"gradients ({likelihood})")
    assert_close(G.T @ G, want.T @ want, f"EF ({likelihood})")
    assert_close(diag, (want**2).sum(0), f"diag EF ({likelihood})")
    with gradhooks.paused():
        assert_close(
            value.detach(), sum(loss(model(x[i : i + 1]), y[i : i + 1]) for i in range(10)), "loss"
        )


def augmented_jacobian(model: nn.Module, x: Tensor, layer: str) -> Tensor:
    """``[batch, outputs, out·(in+1)]``: the Jacobian with respect to ``cat([W, b[:, None]], 1)``
    of the Linear ``layer``, row-major (the layout of ``kron(G, A)``)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).reshape(-1)

    with gradhooks.paused():
        jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    W, b = jac[f"{layer}.weight"], jac[f"{layer}.bias"]
    return torch.cat([W, b[..., None]], -1).flatten(2)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_laplace_kron_of_one_example_is_exact(likelihood):
    """``BackPackGGN.kron(X[:1], y[:1], N=1)``: for one example, every Linear's Kronecker
    factors give its GGN block exactly, ``kron(G, A) = Jᵀ Λ J`` over ``[W, b]`` (laplace's
    ``test_kron_ggn_reg_backpack_vs_diag_*``). :func:`gradhooks.kfac` with ``fisher="exact"``
    (``mse`` is ``F.mse_loss`` summed: ``Λ = 2·I``)."""
    model = laplace_model(2, tanh=True)
    x = seeded(lambda: torch.randn(1, 3), 711).double()
    y = laplace_targets(likelihood, 1)
    loss = "mse" if likelihood == "regression" else "cross_entropy"
    factors = gradhooks.kfac(model, x, y, fisher="exact", loss=loss, reduction="sum")
    lam = output_hessian(model(x).detach(), likelihood) * (2 if loss == "mse" else 1)
    for layer in ("0", "2"):
        f = factors[f"{layer}.weight"]
        J = augmented_jacobian(model, x, layer)
        assert_close(torch.kron(f.G, f.A), torch.einsum("ncp,ncd,ndq->pq", J, lam, J), layer)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_laplace_kron_grows_with_repeated_examples(likelihood):
    """``BackPackGGN.kron(X, y, N=7)`` of one example repeated 7 times is 7 times that of the
    example alone (laplace's ``test_kron_normalization_*``): under ``reduction="sum"`` ``A``
    stays a mean and ``G`` sums."""
    model = laplace_model(2, tanh=True)
    x = seeded(lambda: torch.randn(1, 3), 711).double()
    y = laplace_targets(likelihood, 1)
    loss = "mse" if likelihood == "regression" else "cross_entropy"
    one = gradhooks.kfac(model, x, y, fisher="exact", loss=loss, reduction="sum")
    seven = gradhooks.kfac(
        model, x.repeat_interleave(7, 0), y.repeat_interleave(7, 0), fisher="exact", loss=loss,
        reduction="sum",
    )  # fmt: skip
    for name in one:
        assert_close(seven[name].A, one[name].A, f"{name}: A")
        assert_close(seven[name].G, 7 * one[name].G, f"{name}: G")


# == Opacus: fast gradient clipping (grad_sample_module_fast_gradient_clipping_test.py) ==========


class OpacusSampleModule(nn.Module):
    """Opacus' ``SampleModule`` of its fast-clipping test: Linear, ReLU, LayerNorm, three
    Linears over every position of a ``[batch, length, 2]`` sequence, the positions' scores
    flattened and put through a softmax (narrower here: 64 for its 1024)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.fc1, self.fc3 = nn.Linear(2, 2), nn.Linear(2, width)
        self.fc4, self.fc5 = nn.Linear(width, width), nn.Linear(width, 1)
        self.layer_norm = nn.LayerNorm(2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer_norm(F.relu(self.fc1(x)))
        return F.softmax(self.fc5(self.fc4(self.fc3(x))).flatten(start_dim=1), dim=1)


def soft_ce_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="sum")


@pytest.mark.parametrize("method", ["ghost", "bookkeeping", "grad1"])
@pytest.mark.parametrize("length", [1, 5])
def test_opacus_fast_gradient_clipping_of_its_sample_module(length, method):
    """``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)`` against
    ``GradSampleModule`` + ``DPOptimizer`` (Opacus' ``test_norm_calculation_fast_gradient_
    clipping`` and ``test_gradient_calculation_fast_gradient_clipping``): per parameter, the
    per-example norms; then the clipped mean gradient (at the median norm, no noise) of a
    cross-entropy with soft targets over the positions, as ``DPLossFastGradientClipping``
    takes it. Against the per-example loop's."""
    model = seeded(OpacusSampleModule).double()
    torch.manual_seed(1)
    x = torch.randn(10, length, 2, dtype=D)
    target = torch.randint(0, 2, (10, length)).double()
    want = vmap_grad(model, soft_ce_sum, x, target)
    C = flat_oracle(want, model).norm(dim=1).median().item() or 1.0  # (1.0 clips none here)
    norms, sums = oracle_clipped(want, C)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = F.cross_entropy(model(x), target, reduction="none")
        got = gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0, method=method)
        per_param = (
            {n: p.grad1.flatten(1).norm(dim=1) for n, p in trainable(model).items()}
            if method == "grad1"
            else h.param_norms()
        )
    if length == 1:  # a softmax over one position is constant: every gradient is zero
        assert (norms == 0).all()
    else:
        assert (norms > C).any() and (norms < C).any(), "both clipped and unclipped examples"
    assert_close(got, norms, f"{method}: whole-model norms")
    for n, v in param_norms_of(want).items():
        assert_close(per_param[n], v, f"{method}: per-parameter norms of {n}")
    for n, p in trainable(model).items():
        assert_close(p.grad, sums[n] / 10, f"{method}: clipped mean of {n}")


class SeqLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).mean(1)


class Conv2dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 3, 3, stride=2)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(3, 5, 3, dilation=2), nn.Conv1d(5, 3, 2, groups=1)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(x))).mean(2)


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(7, 4), nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum(1)


class LayerNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.ln(self.fc1(x))).mean(1)


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.fc = nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.gn(self.conv(x))).mean((2, 3)))


FAST_CLIPPING_MODELS = {
    "linear_sequence": (SeqLinear, lambda b: torch.randn(b, 6, 4)),
    "conv2d": (Conv2dNet, lambda b: torch.randn(b, 2, 7, 7)),
    "conv1d": (Conv1dNet, lambda b: torch.randn(b, 3, 11)),
    "embedding_repeated": (EmbeddingNet, lambda b: torch.randint(0, 7, (b, 9))),
    "layer_norm": (LayerNormNet, lambda b: torch.randn(b, 5, 4)),
    "group_norm": (GroupNormNet, lambda b: torch.randn(b, 2, 6, 6)),
}


@pytest.mark.parametrize("method", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("name", list(FAST_CLIPPING_MODELS))
def test_opacus_ghost_norms_and_clipped_sum_equal_the_materialized_ones(name, method):
    """Fast gradient clipping against materialized per-sample gradients on Linear (over a
    sequence), Conv2d, Conv1d, Embedding (repeated indices), LayerNorm and GroupNorm models
    (Opacus' fast-clipping tests, its ``embedding_norm_sample_test.py``): each parameter's
    per-example norms (``Hooks.param_norms``), the whole model's (``Hooks.norms``), and the
    clipped sum (:func:`gradhooks.clipped_sum`) at a norm that clips about half the examples."""
    factory, inputs = FAST_CLIPPING_MODELS[name]
    model = seeded(factory).double()
    x = as_double(seeded(lambda: inputs(8), 1))
    y = seeded(lambda: torch.randint(3, (8,)), 2)
    want = vmap_grad(model, ce_sum, x, y)
    full = flat_oracle(want, model).norm(dim=1)
    C = full.median().item()
    norms, sums = oracle_clipped(want, C)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        result = gradhooks.clipped_sum(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=C, method=method
        )
        for n, v in param_norms_of(want).items():
            assert_close(h.param_norms()[n], v, f"{name} ({method}): norms of {n}")
        assert_close(h.norms(), norms, f"{name} ({method}): whole-model norms")
    assert_close(result.norms, norms, f"{name} ({method}): returned norms")
    for (n, _), s in zip(trainable(model).items(), result.sums):
        assert_close(s, sums[n], f"{name} ({method}): clipped sum of {n}")


class OpacusClipNet(nn.Module):
    """Opacus' ``SampleConvNet`` of ``per_sample_gradient_clip_test.py``: a Conv2d, a pool, the
    image viewed as a sequence, a Conv1d, a frozen 1x1 Conv1d, a Linear over the positions'
    ``[batch, 32, 23]`` and a Linear (narrower channels here)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 8, 3), nn.Conv1d(4, 6, 3, 1)
        self.convf = nn.Conv1d(6, 6, 1, 1)
        self.convf.requires_grad_(False)
        self.fc1, self.fc2 = nn.Linear(23, 5), nn.Linear(6 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = F.relu(self.conv2(x.view(x.shape[0], x.shape[1], -1)))
        x = self.fc1(self.convf(x))
        return self.fc2(x.view(-1, x.shape[-2] * x.shape[-1]))


@pytest.mark.parametrize("method", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("clip", [0.003, 9999.0], ids=["tiny", "huge"])
def test_opacus_flat_clipping_of_its_conv_to_conv1d_net(clip, method):
    """``PerSampleGradientClipper(ConstantFlatClipper(clip))`` (Opacus'
    ``per_sample_gradient_clip_test.py``): with a tiny norm every parameter's clipped gradient
    is smaller than the plain one, and not zero; with a huge one the step is the plain mean
    gradient; the frozen layer gets nothing. Against the loop's clipped mean."""
    model = seeded(OpacusClipNet).double()
    x = seeded(lambda: torch.randn(8, 1, 35, 35), 1).double()
    y = seeded(lambda: torch.randint(10, (8,)), 2)
    want = vmap_grad(model, ce_sum, x, y)
    _, sums = oracle_clipped(want, clip)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=clip, noise_multiplier=0.0, method=method)
    assert model.convf.weight.grad is None and not hasattr(model.convf.weight, "grad1")
    for n, p in trainable(model).items():
        assert_close(p.grad, sums[n] / 8, f"clip {clip} ({method}): {n}")
        plain = want[n].mean(0)
        if clip < 1:
            assert 0 < p.grad.norm() < plain.norm(), n
        else:
            assert_close(p.grad, plain, f"huge clip is no clipping: {n}")


# == Opacus: BatchMemoryManager, Poisson sampling, virtual steps ================================


@pytest.mark.parametrize("max_physical", [3, None], ids=["split", "whole"])
def test_opacus_batch_memory_manager_splits_a_logical_batch(max_physical):
    """``BatchMemoryManager(max_physical_batch_size=...)`` (Opacus'
    ``batch_memory_manager_test.py``): the physical batches are at most that large, the
    optimizer steps once per logical batch, and that step is the clipped sum over the whole
    logical batch divided by the expected batch size (no noise here), as if it had been one
    batch. :func:`gradhooks.make_private` with ``max_physical_batch_size``, SGD at ``lr=1``."""
    model = seeded(classifier).double()
    x = seeded(lambda: torch.randn(40, 4), 1).double()
    y = seeded(lambda: torch.randint(3, (40,)), 2)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), TensorDataset(x, y), delta=1e-5,
        max_grad_norm=0.5, noise_multiplier=0.0, steps=4, expected_batch_size=10,
        max_physical_batch_size=max_physical, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    logical_x, logical_y, steps, sizes = [], [], 0, []
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for bx, by in private.batches():
        sizes.append(len(bx))
        logical_x.append(bx)
        logical_y.append(by)
        private.backward(F.cross_entropy(model(bx), by, reduction="none"))
        if private.step():
            steps += 1
            lx, ly = torch.cat(logical_x), torch.cat(logical_y)
            want = vmap_grad(_at(model, before), ce_sum, lx, ly)
            _, sums = oracle_clipped(want, 0.5)
            for n, p in model.named_parameters():
                assert_close(p.detach(), before[n] - sums[n] / 10, f"step {steps}: {n}")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            logical_x, logical_y = [], []
    private.close()
    assert steps == 4
    if max_physical is not None:
        assert max(sizes) <= max_physical and len(sizes) > 4
    else:
        assert len(sizes) == 4


def _at(model: nn.Module, params: dict[str, Tensor]) -> nn.Module:
    """A copy of ``model`` (no hooks) with the parameters ``params``."""
    other = copy.deepcopy(model)  # (a copy's hooks are inert)
    with torch.no_grad():
        for n, p in other.named_parameters():
            p.copy_(params[n])
    return other


def test_opacus_poisson_sampler_includes_each_example_at_the_sampling_rate():
    """``UniformWithReplacementSampler`` (Opacus' ``poisson_test.py``): each example is in a
    batch independently with probability ``q``; over 400 batches of 50 examples at ``q = 0.1``
    the total count and every example's count are within 5 standard deviations of their
    binomial means, the batch sizes' variance near ``nq(1-q)``, and pairs of examples appear
    together at ``q²``."""
    n, q, steps = 50, 0.1, 400
    sampler = gradhooks.PoissonSampler(
        n, n * q, steps=steps, generator=torch.Generator().manual_seed(0)
    )
    assert len(sampler) == steps and sampler.sample_rate == pytest.approx(q)
    hits = torch.zeros(steps, n)
    for k, idx in enumerate(sampler):
        assert idx == sorted(set(idx))
        hits[k, idx] = 1
    total, sd = hits.sum().item(), math.sqrt(n * steps * q * (1 - q))
    assert abs(total - n * steps * q) < 5 * sd
    per = hits.sum(0)
    assert ((per - steps * q).abs() < 5 * math.sqrt(steps * q * (1 - q))).all()
    sizes = hits.sum(1)
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.3)
    together = (hits.T @ hits).fill_diagonal_(0).sum().item() / (n * (n - 1) * steps)
    assert together == pytest.approx(q * q, rel=0.15)


def test_opacus_poisson_sampler_same_seed_same_batches_next_epoch_differs():
    """Opacus' ``poisson_test.py`` / ``randomness_test.py``: the same generator seed gives the
    same batches; iterating again continues the stream (the next epoch differs)."""
    a = gradhooks.PoissonSampler(30, 5, generator=torch.Generator().manual_seed(7))
    b = gradhooks.PoissonSampler(30, 5, generator=torch.Generator().manual_seed(7))
    first_a, first_b = list(a), list(b)
    assert first_a == first_b
    assert list(a) != first_a


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_virtual_steps_draw_the_noise_once(method):
    """``optimizer.virtual_step()`` over three physical batches, then ``step()`` (Opacus'
    ``virtual_step_test.py``): the step is that of the three as one batch, noise included:
    :class:`gradhooks.DPOptimizer` draws it once, from its generator, as
    :func:`gradhooks.dp_sgd_step` on the whole batch does from the same seed."""
    x = seeded(lambda: torch.randn(12, 4), 1).double()
    y = seeded(lambda: torch.randint(3, (12,)), 2)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    kw = dict(max_grad_norm=0.7, noise_multiplier=1.3, expected_batch_size=12)
    one = seeded(classifier).double()
    with gradhooks.add_hooks(one, quantities=quantities) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(one(x), y, reduction="none"), max_norm=0.7, noise_multiplier=1.3,
            method=method, expected_batch_size=12, generator=torch.Generator().manual_seed(5),
        )  # fmt: skip
    three = seeded(classifier).double()
    with gradhooks.add_hooks(three, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(three.parameters(), lr=0.0), h, method=method,
            generator=torch.Generator().manual_seed(5), **kw,
        )  # fmt: skip
        for part in (slice(0, 5), slice(5, 9), slice(9, 12)):
            opt.backward(F.cross_entropy(three(x[part]), y[part], reduction="none"))
        opt.step()
    for (n, p), q in zip(one.named_parameters(), three.parameters()):
        assert_close(q.grad, p.grad, f"{method}: {n}")


# == private-vision: mixed ghost clipping of CNNs ================================================


class MixedCNN(nn.Module):
    """A CNN whose layers' cheaper norm differs (private-vision's "mixed ghost clipping"): a
    first convolution over 1024 positions with few features (its per-example gradient is
    cheaper than the ``T²`` Gram matrices), a last one over 64 positions with many (the Gram
    form is cheaper), GroupNorm between them, a Linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 2, 3, padding=1)
        self.c2 = nn.Conv2d(2, 32, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(4, 32)
        self.c3 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(F.relu(self.c3(self.gn(x))).mean((2, 3)))


class ResidualCNN(nn.Module):
    """A small ResNet (private-vision's CIFAR ResNets with GroupNorm): a stem, one basic block
    with a skip connection, a pooled Linear head."""

    def __init__(self):
        super().__init__()
        self.stem, self.gn0 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8)
        self.conv1, self.gn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8)
        self.conv2, self.gn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.gn0(self.stem(x)))
        x = F.relu(x + self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x))))))
        return self.fc(x.mean((2, 3)))


VISION_MODELS = {
    "mixed_cnn": (MixedCNN, lambda b: torch.randn(b, 1, 32, 32)),
    "resnet_block": (ResidualCNN, lambda b: torch.randn(b, 3, 8, 8)),
}


@pytest.mark.parametrize("method", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("name", list(VISION_MODELS))
def test_private_vision_mixed_ghost_clipping_of_cnns(name, method):
    """private-vision's ``PrivacyEngine(clipping_mode="MixGhostClip")`` on CNNs: per layer, the
    per-example norm by whichever of the Gram ("ghost") and the materialized forms is cheaper,
    the clipped mean gradient as the per-example loop's. Here both forms occur in one model
    (``Hooks.norm_forms``) and every parameter's norm is the oracle's."""
    factory, inputs = VISION_MODELS[name]
    model = seeded(factory).double()
    x = seeded(lambda: inputs(4), 1).double()
    y = seeded(lambda: torch.randint(10, (4,)), 2)
    want = vmap_grad(model, ce_sum, x, y)
    C = flat_oracle(want, model).norm(dim=1).median().item()
    norms, sums = oracle_clipped(want, C)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        got = gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0, method=method)
        forms = h.norm_forms()
        for n, v in param_norms_of(want).items():
            assert_close(h.param_norms()[n], v, f"{name} ({method}, {forms[n]}): {n}")
    if name == "mixed_cnn":
        assert {"gram", "materialized"} <= set(forms.values()), forms
    assert_close(got, norms, f"{name} ({method}): norms")
    for n, p in trainable(model).items():
        assert_close(p.grad, sums[n] / 4, f"{name} ({method}): clipped mean of {n}")


# == pyvacy: DP-SGD as a per-example loop =========================================================


def pyvacy_step(
    model, x, y, max_norm, sigma, generator, microbatch: int = 1, minibatch: int | None = None
) -> dict[str, Tensor]:
    """pyvacy's ``DPSGD`` step, as its loop runs it: for each micro-batch (of ``microbatch``
    examples), the gradient of its summed loss clipped to ``max_norm`` as a whole, added up;
    then per parameter, in order, ``σ·C·N(0, I)`` drawn from ``generator``; the sum divided
    by the minibatch size (``minibatch``, the expected size of its Poisson-sampled batches;
    by default the batch's own). Returns ``{name: gradient}``."""
    params = trainable(model)
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    with gradhooks.paused():
        for s in range(0, x.shape[0], microbatch):
            model.zero_grad()
            ce_sum(model(x[s : s + microbatch]), y[s : s + microbatch]).backward()
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values()))
            factor = min(1.0, max_norm / (norm.item() + 1e-300))
            for n, p in params.items():
                total[n] += factor * p.grad
    model.zero_grad()
    for n, p in params.items():
        z = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        total[n] = (total[n] + sigma * max_norm * z) / (minibatch or x.shape[0])
    return total


@pytest.mark.parametrize("expected", [None, 8], ids=["own_size", "expected_size"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_pyvacy_per_example_loop_step_with_its_noise(method, expected):
    """pyvacy's ``optim.DPSGD`` (``microbatch_size=1``): a loop over the examples, each
    gradient clipped, summed, Gaussian noise ``σ·C`` added per parameter, divided by the
    minibatch size (its ``IIDBatchSampler`` draws Poisson batches, whose own size varies:
    the divisor is then the expected size, ``expected_batch_size=``).
    :func:`gradhooks.dp_sgd_step` with the same generator seed draws the same noise,
    parameter after parameter, so the whole step, noise included, is the loop's."""
    model = seeded(conv_classifier).double()
    x = seeded(lambda: torch.randn(6, 1, 7, 7), 1).double()
    y = seeded(lambda: torch.randint(3, (6,)), 2)
    want = pyvacy_step(model, x, y, 0.05, 1.1, torch.Generator().manual_seed(9), 1, expected)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.05,
            noise_multiplier=1.1, method=method, generator=torch.Generator().manual_seed(9),
            expected_batch_size=expected,
        )  # fmt: skip
    for n, p in trainable(model).items():
        assert_close(p.grad, want[n], f"{method}: {n}")


@pytest.mark.parametrize("microbatch", [2, 3])
def test_pyvacy_microbatch_clipping_from_grad1(microbatch):
    """pyvacy's ``microbatch_size > 1``: the unit clipped is a micro-batch's summed gradient.
    gradhooks has no micro-batch clipping; ``grad1`` summed within each micro-batch, clipped
    and summed, with the noise of the same generator, is pyvacy's step."""
    model = seeded(classifier).double()
    x = seeded(lambda: torch.randn(6, 4), 1).double()
    y = seeded(lambda: torch.randint(3, (6,)), 2)
    want = pyvacy_step(model, x, y, 0.3, 0.8, torch.Generator().manual_seed(4), microbatch)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        ce_sum(model(x), y).backward()
    params = trainable(model)
    groups = {n: p.grad1.view(-1, microbatch, *p.shape).sum(1) for n, p in params.items()}
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in groups.values()]).sum(0).sqrt()
    factors = gradhooks.clip_factors(norms, 0.3)
    g = torch.Generator().manual_seed(4)
    for n, p in params.items():
        z = torch.randn(p.shape, generator=g, dtype=D)
        step = (torch.einsum("m,m...->...", factors, groups[n]) + 0.8 * 0.3 * z) / 6
        assert_close(step, want[n], f"micro-batches of {microbatch}: {n}")


# == data attribution: TRAK, torch-influence, the gradient noise scale ============================


def margin_sum(out: Tensor, y: Tensor) -> Tensor:
    """TRAK's model output function for classification, summed over the batch: the margin
    ``f = logit_y - logsumexp(other logits)`` of each example."""
    correct = out.gather(1, y[:, None])[:, 0]
    others = out.masked_fill(torch.arange(out.shape[1]) == y[:, None], float("-inf"))
    return (correct - others.logsumexp(1)).sum()


def projector(P: int, k: int, kind: str) -> Tensor:
    """TRAK's ``BasicProjector``: a ``[P, k]`` Gaussian or Rademacher matrix scaled by
    ``1/√k``, from a fixed seed."""
    g = torch.Generator().manual_seed(17)
    if kind == "normal":
        M = torch.randn(P, k, generator=g, dtype=D)
    else:
        M = torch.randint(0, 2, (P, k), generator=g).to(D) * 2 - 1
    return M / math.sqrt(k)


@pytest.mark.parametrize("proj", ["normal", "rademacher"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_trak_projected_per_example_gradients(kind, proj):
    """TRAK's ``featurize``: the per-example gradients of the margin (``vmap(grad)`` of
    ``functional_call`` there) projected to ``k`` dimensions (``trak/tests/test_projectors.py``
    and ``test_gradient_computers.py``): ``grad1`` of the summed margins (``loss_reduction=
    "sum"``), flattened and projected, against the oracle's."""
    model = seeded(classifier if kind == "mlp" else conv_classifier).double()
    x, y = classification_data(kind, 8, 1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        margin_sum(model(x), y).backward()
    P = sum(p.numel() for p in model.parameters())
    M = projector(P, 16, proj)
    want = flat_oracle(vmap_grad(model, margin_sum, x, y), model)
    assert_close(flat_grad1(model) @ M, want @ M, f"TRAK features ({kind}, {proj})")


def test_trak_per_example_gradients_at_checkpoint_weights_by_functional_call():
    """TRAK featurizes each checkpoint by ``torch.func.functional_call(model, weights, x)``
    with the checkpoint's weights, not the module's own (``FunctionalGradientComputer``).
    Under the hooks, ``grad1`` goes to the tensors the call used (the oracle's gradients at
    those weights), and the module's own parameters, unused, get none."""
    model = seeded(classifier).double()
    x, y = classification_data("mlp", 8, 1)
    g = torch.Generator().manual_seed(5)
    weights = {
        n: (p.detach() + 0.5 * torch.randn(p.shape, generator=g, dtype=D)).requires_grad_()
        for n, p in model.named_parameters()
    }
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        margin_sum(functional_call(model, weights, (x,)), y).backward()
    at = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in at.named_parameters():
            p.copy_(weights[n])
    want = vmap_grad(at, margin_sum, x, y)
    for n, w in weights.items():
        assert_close(w.grad1, want[n], f"checkpoint weight {n}")
        assert not hasattr(dict(model.named_parameters())[n], "grad1"), n


class TinyCausalLM(nn.Module):
    """A two-layer causal Transformer language model (token and learned position embeddings,
    ``nn.TransformerEncoder`` with a causal mask and a padding mask, a vocabulary head): the
    kind of model TRAK attributes text generation with."""

    def __init__(self, norm_first: bool):
        super().__init__()
        self.emb, self.pos = nn.Embedding(11, 8), nn.Parameter(0.1 * torch.randn(6, 8))
        layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 11)

    def forward(self, idx: Tensor, pad: Tensor) -> Tensor:
        T = idx.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        h = self.emb(idx) + self.pos[:T]
        return self.head(self.enc(h, mask=causal, src_key_padding_mask=pad, is_causal=True))


def token_margins_sum(out: Tensor, y: Tensor) -> Tensor:
    """TRAK's ``TextClassificationModelOutput`` margin, per token, summed over each example's
    tokens and the batch."""
    correct = out.gather(2, y[..., None])[..., 0]
    others = out.masked_fill(torch.arange(out.shape[2]) == y[..., None], float("-inf"))
    return (correct - others.logsumexp(2)).sum()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_trak_margin_gradients_of_a_causal_language_model(norm_first):
    """TRAK on a language model (its ``LanguageModelingModelOutput`` and text examples): the
    per-example gradients of the token margins of a causal Transformer with padded examples
    (eval mode, as TRAK featurizes), every parameter, against the per-example loop, and their
    projected features."""
    model = seeded(lambda: TinyCausalLM(norm_first)).double().eval()
    idx, y = seeded(lambda: (torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))), 1)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[1, 4:], pad[3, 5:] = True, True
    want = loop_grad(model, token_margins_sum, (idx, pad), y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        token_margins_sum(model(idx, pad), y).backward()
    assert_grad1(model, want, f"causal LM (norm_first={norm_first})")
    M = projector(sum(p.numel() for p in model.parameters()), 32, "rademacher")
    assert_close(flat_grad1(model) @ M, flat_oracle(want, model) @ M, "projected")


def test_trak_scores_from_the_features():
    """TRAK's scores (``TRAKer.score`` of one model): ``φ_test (ΦᵀΦ)⁻¹ Φᵀ Q``, with ``Φ`` the
    training examples' projected margin gradients and ``Q = diag(1 - p_y)`` (its
    ``out_to_loss``), from gradhooks' features against the oracle's."""
    model = seeded(classifier).double()
    x, y = classification_data("mlp", 24, 1)
    xt, yt = classification_data("mlp", 4, 2)
    P = sum(p.numel() for p in model.parameters())
    M = projector(P, 12, "normal")

    def features(xs, ys):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            margin_sum(model(xs), ys).backward()
        out = flat_grad1(model) @ M
        gradhooks.clear_grad1(model)
        model.zero_grad()
        return out

    def scores(phi, phi_t):
        with torch.no_grad():
            q = 1 - model(x).softmax(1).gather(1, y[:, None])[:, 0]
        return phi_t @ torch.linalg.solve(phi.T @ phi, phi.T) * q

    got = scores(features(x, y), features(xt, yt))
    want_phi = flat_oracle(vmap_grad(model, margin_sum, x, y), model) @ M
    want_phi_t = flat_oracle(vmap_grad(model, margin_sum, xt, yt), model) @ M
    assert_close(got, scores(want_phi, want_phi_t), "TRAK scores")


def bce_sum(out: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(out[:, 0], y, reduction="sum")


def influence_problem(kind: str):
    """A logistic (``Linear(5, 1)``, BCE) or softmax (``Linear(5, 3)``, CE) regression with
    its data: torch-influence's convex test problems."""
    torch.manual_seed(3)
    x, xt = torch.randn(30, 5, dtype=D), torch.randn(4, 5, dtype=D)
    if kind == "logistic":
        model, loss = nn.Linear(5, 1).double(), bce_sum
        y, yt = torch.randint(2, (30,)).double(), torch.randint(2, (4,)).double()
    else:
        model, loss = nn.Linear(5, 3).double(), ce_sum
        y, yt = torch.randint(3, (30,)), torch.randint(3, (4,))
    return model, loss, x, y, xt, yt


def per_example_losses(out: Tensor, y: Tensor) -> Tensor:
    """``[batch]``: the BCE (one logit) or cross-entropy of each example."""
    if out.shape[1] == 1:
        return F.binary_cross_entropy_with_logits(out[:, 0], y, reduction="none")
    return F.cross_entropy(out, y, reduction="none")


def regularized(model, x, y, damping, weights=None):
    """``θ ↦ (1/n) Σᵢ wᵢ ℓᵢ(θ) + damping/2 ‖θ‖²`` of the flattened parameters (``wᵢ = 1``)."""
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def f(theta):
        params, at = {}, 0
        for n, s in shapes.items():
            params[n] = theta[at : at + math.prod(s)].view(s)
            at += math.prod(s)
        losses = per_example_losses(functional_call(model, params, (x,)), y)
        value = losses.sum() if weights is None else (weights * losses).sum()
        return value / x.shape[0] + 0.5 * damping * theta.pow(2).sum()

    return f


def hessian(f):
    """``f``'s Hessian by reverse over reverse (no forward-mode decompositions)."""
    return torch.func.jacrev(torch.func.grad(f))


def newton(f, theta, steps: int = 12):
    for _ in range(steps):
        g = torch.func.grad(f)(theta)
        theta = theta - torch.linalg.solve(hessian(f)(theta), g)
    return theta


@pytest.mark.parametrize("kind", ["logistic", "softmax"])
def test_torch_influence_of_up_weighting_a_training_example(kind):
    """torch-influence's ``AutogradInfluenceModule.influences(train_idxs, test_idxs)``:
    ``I(z_i, z_test) = -∇L_testᵀ (H + λI)⁻¹ ∇ℓ_i`` at the optimum of a convex regression
    (its ``tests/test_influence.py`` on logistic regression). The training examples' gradients
    from ``grad1`` against the oracle's, and the influences against the derivative of the
    test loss when example ``i``'s weight is raised by ``ε`` and the model re-trained
    (central differences)."""
    model, loss, x, y, xt, yt = influence_problem(kind)
    damping, n = 0.01, x.shape[0]
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    f = regularized(model, x, y, damping)
    with gradhooks.paused():
        theta = newton(f, theta)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(theta, model.parameters())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x), y).backward()
    G = flat_grad1(model)
    assert_close(G, flat_oracle(vmap_grad(model, loss, x, y), model), f"{kind}: train gradients")
    with gradhooks.paused():
        H = hessian(f)(theta)
        test_loss = regularized(model, xt, yt, 0.0)
        g_test = torch.func.grad(test_loss)(theta)
    influences = -(G / n) @ torch.linalg.solve(H, g_test)
    eps = 1e-4
    for i in (0, 7):
        moved = []
        for sign in (1, -1):
            w = torch.ones(n, dtype=D)
            w[i] += sign * eps
            with gradhooks.paused():
                moved.append(test_loss(newton(regularized(model, x, y, damping, w), theta, 4)))
        by_retraining = (moved[0] - moved[1]) / (2 * eps)
        torch.testing.assert_close(influences[i], by_retraining, rtol=1e-6, atol=1e-10)


def noise_scale_oracle(want: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(tr Σ, ‖G‖², B_simple)`` from per-example gradients: the unbiased trace of their
    covariance, the squared norm of their mean, and the ratio."""
    g = torch.cat([v.flatten(1) for v in want.values()], 1)
    B = g.shape[0]
    mean = g.mean(0)
    trace = (g - mean).pow(2).sum() / (B - 1)
    return trace, mean.pow(2).sum(), trace / mean.pow(2).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("quantity", ["norms", "sum_grad_sq"])
def test_gradient_noise_scale_from_per_example_norms(quantity, reduction):
    """McCandlish et al.'s simple noise scale ``B_simple = tr Σ / ‖G‖²``, with ``tr Σ`` the
    unbiased ``(Σᵢ‖gᵢ‖² - B‖ḡ‖²)/(B-1)``: ``Σᵢ‖gᵢ‖²`` from the per-example norms
    (``Hooks.norms``) or from ``Hooks.sum_grad_sq``, ``ḡ`` from ``.grad`` (divided by ``B``
    under a sum), never forming ``grad1``."""
    model = seeded(conv_classifier).double()
    x, y = classification_data("conv", 10, 1)
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=(quantity,)) as h:
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        if quantity == "norms":
            sq = h.norms().pow(2).sum()
        else:
            sq = sum(v.sum() for v in h.sum_grad_sq().values())
    B = 10
    mean = torch.cat([p.grad.flatten() for p in model.parameters()]) / (
        B if reduction == "sum" else 1
    )
    trace = (sq - B * mean.pow(2).sum()) / (B - 1)
    want_trace, want_g2, want_simple = noise_scale_oracle(vmap_grad(model, ce_sum, x, y))
    assert not hasattr(model[0].weight, "grad1")
    assert_close(trace, want_trace, "tr Σ")
    assert_close(mean.pow(2).sum(), want_g2, "‖G‖²")
    assert_close(trace / mean.pow(2).sum(), want_simple, "B_simple")


def test_gradient_noise_scale_two_batch_estimators_and_per_layer_variance():
    """McCandlish et al.'s Appendix A estimators from two batch sizes, ``|G|² ≈ (B_big‖G_big‖² -
    B_small‖G_small‖²)/(B_big - B_small)`` and ``S ≈ (‖G_small‖² - ‖G_big‖²)/(1/B_small -
    1/B_big)``: with ``B_small = 1`` (the per-example gradients, their squared norms
    averaged) they are the unbiased ``‖ḡ‖² - tr Σ/B`` and ``tr Σ``. And per layer,
    ``Hooks.grad_variance`` (the population variance) summed and scaled by ``B/(B-1)`` is
    each layer's ``tr Σ``."""
    model = seeded(classifier).double()
    x, y = classification_data("mlp", 12, 1)
    B = 12
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq")) as h:
        F.cross_entropy(model(x), y).backward()
        small = h.norms().pow(2).mean()
        variance = h.grad_variance()
    big = sum(p.grad.pow(2).sum() for p in model.parameters())
    g2 = (B * big - small) / (B - 1)
    S = (small - big) / (1 - 1 / B)
    want = vmap_grad(model, ce_sum, x, y)
    want_trace, want_g2, _ = noise_scale_oracle(want)
    assert_close(S, want_trace, "S")
    assert_close(g2, want_g2 - want_trace / B, "|G|²")
    for n, g in want.items():
        layer_trace, _, _ = noise_scale_oracle({n: g})
        assert_close(variance[n].sum() * B / (B - 1), layer_trace, f"tr Σ of {n}")


@pytest.mark.parametrize("use", ["tracin", "trak", "noise_scale", "laplace_jacobians"])
def test_attribution_with_batch_norm_in_training_is_refused(use):
    """With BatchNorm in train mode no example has a gradient of its own (each output depends
    on the whole batch): TracIn's and TRAK's per-example gradients, the noise scale's norms
    and laplace's Jacobians are refused with :class:`gradhooks.MixedExamplesError` naming the
    layer, not computed from the batch's shares."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)))
    model = model.double().train()
    x, y = classification_data("mlp", 8, 1)
    with pytest.raises(gradhooks.MixedExamplesError, match="BatchNorm1d"):
        if use == "laplace_jacobians":
            gradhooks.jacobians(model, x)
        else:
            quantities = ("norms",) if use == "noise_scale" else ("grad1",)
            with gradhooks.add_hooks(model, loss_reduction="sum", quantities=quantities):
                out = model(x)
                (margin_sum(out, y) if use == "trak" else ce_sum(out, y)).backward()
    assert all(not hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(FAST_CLIPPING_MODELS))
def test_gradient_noise_scale_per_layer_from_grad_variance(name, reduction):
    """The per-layer noise scale (the gradient noise scale of each parameter, as training
    monitors log it): ``Hooks.grad_variance`` (``mean_i grad1[i]² - (mean_i grad1[i])²``,
    elementwise, the mean formed from the layer's kept inputs where that is cheaper) and
    ``Hooks.sum_grad_sq`` on the Linear (over a sequence), Conv, Embedding, LayerNorm and
    GroupNorm models, under either loss reduction, against the oracle's."""
    factory, inputs = FAST_CLIPPING_MODELS[name]
    model = seeded(factory).double()
    x = as_double(seeded(lambda: inputs(8), 1))
    y = seeded(lambda: torch.randint(3, (8,)), 2)
    want = vmap_grad(model, ce_sum, x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=("sum_grad_sq",)) as h:
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        variance, sq = h.grad_variance(), h.sum_grad_sq()
    for n, g in want.items():
        assert_close(sq[n], g.pow(2).sum(0), f"{name} ({reduction}): sum_grad_sq of {n}")
        population = (g.pow(2).mean(0) - g.mean(0).pow(2)).clamp_min(0)
        assert_close(variance[n], population, f"{name} ({reduction}): variance of {n}")


CONV_KINDS = {
    "depthwise": (lambda: nn.Conv2d(8, 8, 3, groups=8, padding=1), (4, 8, 6, 6)),
    "grouped_strided": (lambda: nn.Conv2d(8, 12, 3, groups=4, stride=2), (4, 8, 9, 9)),
    "circular_padding": (
        lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        (4, 3, 6, 6),
    ),
    "reflect_dilated": (
        lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect", dilation=2),
        (4, 3, 7, 7),
    ),  # fmt: skip
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, stride=2), (4, 2, 4, 4, 4)),
    "transposed": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1), (4, 3, 4, 4)),
    "transposed_grouped": (lambda: nn.ConvTranspose1d(4, 6, 3, groups=2, dilation=2), (4, 4, 7)),
}


class ConvHead(nn.Module):
    def __init__(self, conv: nn.Module, features: int):
        super().__init__()
        self.conv, self.fc = conv, nn.Linear(features, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("form", ["gram", "materialized"])
@pytest.mark.parametrize("kind", list(CONV_KINDS))
def test_private_vision_conv_layers_under_either_norm_form(kind, form):
    """private-vision's ghost norms of the convolutions of its CNNs (depthwise and grouped as
    in MobileNet / EfficientNet, non-zero padding modes, 3-d, transposed), each under the
    Gram and the materialized form (forced by :func:`gradhooks.tuned`: only the cost decides
    between them): norms per parameter and the clipped sum, by ghost clipping and by
    book-keeping, against the loop's."""
    conv, shape = CONV_KINDS[kind]
    torch.manual_seed(0)
    layer = conv().double()
    x = torch.randn(*shape, dtype=D)
    model = ConvHead(layer, layer(x).flatten(1).shape[1]).double()
    y = torch.randint(3, (shape[0],))
    want = vmap_grad(model, ce_sum, x, y)
    norms, sums = oracle_clipped(want, 0.1)
    for method in ("ghost", "bookkeeping"):
        with gradhooks.tuned(pass_macs=10**9 if form == "gram" else 0):
            with gradhooks.add_hooks(model, quantities=("norms",)) as h:
                losses = F.cross_entropy(model(x), y, reduction="none")
                result = gradhooks.clipped_sum(h, losses, max_norm=0.1, method=method)
                assert h.norm_forms()["conv.weight"] == form
                for n, v in param_norms_of(want).items():
                    assert_close(h.param_norms()[n], v, f"{kind} ({form}, {method}): {n}")
        assert_close(result.norms, norms, f"{kind} ({form}, {method}): norms")
        for (n, _), s in zip(trainable(model).items(), result.sums):
            assert_close(s, sums[n], f"{kind} ({form}, {method}): clipped sum of {n}")


@pytest.mark.parametrize("wrt", ["2.weight,2.bias", "0.weight", "0.bias,2.weight"])
def test_torch_influence_gradients_of_chosen_parameters(wrt):
    """torch-influence's ``BaseInfluenceModule(params_filter=...)`` and Captum's
    ``TracInCP(layers=...)`` take the gradients of some parameters only, by
    ``torch.autograd.grad(loss, chosen)``: under the hooks, exactly the chosen parameters get a
    ``grad1`` (the oracle's), the others none, and no ``.grad`` is written."""
    model = seeded(classifier).double()
    x, y = classification_data("mlp", 8, 1)
    want = vmap_grad(model, ce_sum, x, y)
    chosen = wrt.split(",")
    params = dict(model.named_parameters())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        grads = torch.autograd.grad(ce_sum(model(x), y), [params[n] for n in chosen])
    for n, p in params.items():
        assert p.grad is None
        if n in chosen:
            assert_close(p.grad1, want[n], f"{wrt}: {n}")
            assert_close(grads[chosen.index(n)], want[n].sum(0), f"{wrt}: autograd's {n}")
        else:
            assert not hasattr(p, "grad1"), f"{wrt}: {n} was not asked for"


def test_torch_influence_hessian_vector_products_under_the_hooks():
    """torch-influence's ``CGInfluenceModule`` / ``LiSSAInfluenceModule``: Hessian-vector
    products by double backward (``create_graph=True``). Under the hooks the second backward is
    refused (:class:`gradhooks.UnsupportedError`, saying to pause): its per-example gradients
    would miss the double backward's terms. Under ``h.paused()`` it runs, equals
    ``torch.func``'s product, and the ``grad1`` of the first backward is kept."""
    model = seeded(classifier).double()
    x, y = classification_data("mlp", 8, 1)
    want = vmap_grad(model, ce_sum, x, y)
    params = list(model.parameters())
    v = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=D)
        for i, p in enumerate(params)
    ]
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        grads = torch.autograd.grad(ce_sum(model(x), y), params, create_graph=True)
        dot = sum((g * u).sum() for g, u in zip(grads, v))
        with pytest.raises(gradhooks.UnsupportedError, match="paused"):
            torch.autograd.grad(dot, params, retain_graph=True)
        with h.paused():
            hvp = torch.autograd.grad(dot, params)
    assert_grad1(model, want, "grad1 of the first backward")
    names = [n for n, _ in model.named_parameters()]

    def loss_of(flat_params):
        return ce_sum(functional_call(model, dict(zip(names, flat_params)), (x,)), y)

    with gradhooks.paused():
        _, vjp = torch.func.vjp(torch.func.grad(loss_of), tuple(p.detach() for p in params))
        (want_hvp,) = vjp(tuple(v))  # (the Hessian is symmetric: vᵀH = Hv)
    for n, a, b in zip(names, hvp, want_hvp):
        assert_close(a, b, f"Hv of {n}")


class EmbeddingSum(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb, self.fc = nn.Embedding(7, 4, **kw), nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum(1)


class BagHead(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb, self.fc = nn.EmbeddingBag(7, 4, **kw), nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx))


EMBEDDINGS = {
    "padding_idx": lambda: EmbeddingSum(padding_idx=0),
    "sparse": lambda: EmbeddingSum(sparse=True),
    "sparse_padding_idx": lambda: EmbeddingSum(sparse=True, padding_idx=2),
    "bag_mean": lambda: BagHead(mode="mean"),
    "bag_max": lambda: BagHead(mode="max"),
    "bag_sum_padding_idx": lambda: BagHead(mode="sum", padding_idx=1),
    "bag_sparse": lambda: BagHead(mode="sum", sparse=True),
}


@pytest.mark.parametrize("kind", list(EMBEDDINGS))
def test_opacus_embedding_layers_dp_step_by_every_method(kind):
    """Opacus' ``embedding_test.py``, ``embedding_bag_test.py`` and the Embedding case of its
    fast-clipping test: a DP step (no noise, clipping at the median norm) through Embedding
    with ``padding_idx`` and ``sparse=True`` and EmbeddingBag (mean, max, sum with a padding
    index, sparse), by ``grad1``, ghost clipping and book-keeping, against the loop's clipped
    mean (a sparse ``.grad`` compared densified)."""
    model = seeded(EMBEDDINGS[kind]).double()
    idx = seeded(lambda: torch.randint(0, 7, (6, 5)), 1)
    y = seeded(lambda: torch.randint(3, (6,)), 2)
    want = loop_grad(model, ce_sum, idx, y)
    C = flat_oracle(want, model).norm(dim=1).median().item()
    _, sums = oracle_clipped(want, C)
    for method in ("grad1", "ghost", "bookkeeping"):
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            losses = F.cross_entropy(model(idx), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0, method=method)
        for n, p in trainable(model).items():
            assert_close(p.grad.to_dense(), sums[n] / 6, f"{kind} ({method}): {n}")
            p.grad = None
        gradhooks.clear_grad1(model)


BF16_RTOL = 4 * 2.0**-8
"""bfloat16 keeps 8 significant bits (a rounding is within 2^-9 of the value); the inputs, the
outputs and the output-gradients of each layer are rounded, a few roundings in all: 4·2^-8
relative (measured: at most 5.4e-3 on these models)."""


@pytest.mark.parametrize("name", list(FAST_CLIPPING_MODELS))
def test_gradient_noise_scale_under_bf16_autocast(name):
    """The noise scale's inputs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as
    training monitors measure it in mixed-precision runs: the per-example norms and
    ``sum_grad_sq`` (float32 results of bfloat16 products) against the float64 loop: the
    norms within :data:`BF16_RTOL` per example, each parameter's squared sums within twice
    that as a whole (a first layer's output-gradients come through the bfloat16 backward of
    every layer after it: autograd's own ``.grad`` of ``conv2d``'s first weight is off by
    3.5% here, its squared sums by 1.6%)."""
    factory, inputs = FAST_CLIPPING_MODELS[name]
    model = seeded(factory)
    x = seeded(lambda: inputs(8), 1)
    y = seeded(lambda: torch.randint(3, (8,)), 2)
    want = vmap_grad(copy.deepcopy(model).double(), ce_sum, as_double(x), y)
    norms = flat_oracle(want, model).norm(dim=1)
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq")) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        got, sq = h.norms(), h.sum_grad_sq()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), norms, rtol=BF16_RTOL, atol=0)
    for n, g in want.items():
        ref = g.pow(2).sum(0)
        rel = ((sq[n].double() - ref).norm() / ref.norm()).item()
        assert rel < 2 * BF16_RTOL, f"{name}: sum_grad_sq of {n} off by {rel:.2e} relative"

"""A seventeenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd,
``torch.autograd.functional`` Jacobians and Hessians, ``torch.nn.grad``'s convolution weight
gradient and :mod:`gradhooks.oracle`). The first sixteen sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to
:mod:`test_peer_suites_sixteenth`; this one adds:

- BackPACK's first test suite (``f-dangel/backpack``: ``test/automated_test.py``,
  ``test/test_problems_linear.py``, ``test_problems_activations.py``,
  ``test_problems_convolutions.py``, ``test_problems_bn.py``, ``test/problems.py``,
  ``test/networks.py``): its regression (a summing ``Linear(·, 1)`` under ``MSELoss``),
  classification and two-layer classification problems of a Linear with and without ReLU,
  Sigmoid and Tanh, and of a padded ``Conv2d`` with a ``(3, 2)`` kernel with each activation
  (the classes are the flattened feature map's 72 or 84 entries): ``grad1``, its mean against
  ``.grad``, the squared sums, the per-parameter norms and the variance against the loop
  (``test_batch_gradients``, ``..._sum_to_grad``, ``test_sgs``, ``test_batch_l2``,
  ``test_variance``), also in a float32 model under bfloat16 autocast; the GGN's products
  with 10 random columns (``test_ggn_mp``) from the per-example Jacobians; each parameter's
  GGN block (``test_diag_ggn``) from autograd-hacks' ``backprop_hess`` / ``compute_hess``;
  its BatchNorm problems, refused in training (``grad1``, Jacobians) and the loop's in eval;
- BackPACK (``test/automated_kfac_test.py``, ``test/test_problems_kfacs.py``): for one datum,
  ``kron(G, A)`` of ``fisher="exact"`` is each Linear's GGN block
  (``test_kflr_should_equal_ggn``), and the average of many sampled factors approaches it
  (``test_kfac_should_approx_ggn_montecarlo``);
- BackPACK (``test/linear_test.py``, ``test/conv2d_test.py``): its Linear of integer weights on
  its two examples, ``grad1`` against the closed form ``2·out ⊗ x``; its convolution from
  Chellapilla et al. and its random convolutions (stride, padding, dilation, kernel drawn, the
  peer's test skipped as flaky in float32), against ``torch.nn.grad.conv2d_weight`` per example;
- BackPACK (``test/extensions/test_hooks.py``): a nested ``Sequential`` and a custom container
  of the same two Linears, each parameter's ``grad1`` once, the diagonal GGN from the
  per-example Jacobians, and K-FAC factors for both (BackPACK refuses second order on the
  container); ``test/test_second_order_warnings.py``: a loss scaled after its module
  (``2 · CrossEntropyLoss``, ``2 · MSELoss``), which BackPACK can only warn about, given to
  gradhooks as a function: ``grad1`` and K-FAC's ``G`` scaled by 2 (exact) and 4 (empirical);
- torch's ExpandedWeights tests (``test/test_expanded_weights.py``, ``test_embedding_one``,
  ``test_embedding_two``): an Embedding whose forward renormalizes its rows in place
  (``max_norm``, ``padding_idx``, ``sparse``, ``scale_grad_by_freq``), the forward and the
  table as without the hooks, ``grad1`` the loop's, the DP step refusing the batch-wide
  frequency scaling;
- Opacus' layer benchmarks (``benchmarks/layers.py``, ``benchmarks/tests/test_layers.py``,
  ``test_forward_backward``): each benchmarked layer (Linear, Conv2d, LayerNorm over the last
  axis, affine InstanceNorm1d, GroupNorm of a ``[batch, channels]`` input, Embedding, torch's and
  Opacus' multi-head attention with a key and value longer than the query, RNN / GRU / LSTM and
  Opacus' ``DPRNN`` / ``DPGRU`` / ``DPLSTM`` without bias, from an initial state) under its
  criterion, ``F.cross_entropy`` against soft ``randn`` targets over dimension 1, batch-first
  and time-major (the classes then taken over time), against the loop, the layer's parameters
  left as they were, and the DP step (half the examples clipped) by every method against the
  loop's clipped mean, and against Opacus' own ``grad_sample`` where it takes the layer;
- Opacus (``opacus/tests/multigpu_precision_test.py``, ``mixed_precision_utils.py``): the
  dtypes of mixed precision (float32 parameters, gradients and norms, bfloat16 outputs) and of
  low precision (all bfloat16) in the DP step, whose values are the float64 loop's within
  bfloat16's rounding;
- Opacus (``opacus/tests/validators/batch_norm_test.py``): ``BatchNorm1d/2d/3d`` and
  ``SyncBatchNorm`` refused in training, the model untouched, and after
  :func:`gradhooks.convert_batch_norm` (Opacus' fixer: a ``GroupNorm``) the loop's;
- ASDL (``kazukiosawa/asdl``: ``test/grad_maker/test_grad_maker.py``, ``test/conftest.py``):
  its ``NetworkA`` returning the logits, ``(logits, loss)`` or ``(loss, logits)`` with the
  loss computed in its forward, and its ``NetworkB`` over sequences, whose cross-entropy over
  the flattened tokens skips ``ignore_index=-1`` (a mean over the batch's counted tokens), as
  an ``Output`` dataclass or a tuple.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from test_peer_suites_sixteenth import layer_fisher, loss_hessian_columns
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, assert_untouched, model_state, one_thread  # noqa: F401

D = torch.float64


def opacus_layers():
    return pytest.importorskip("opacus.layers", reason="needs opacus")


# == BackPACK: automated_test.py and its problems ================================================

ACTIVATIONS = {"none": None, "relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


def hidden(act, first: bool = True) -> list[nn.Module]:
    """``networks.py``'s ``HiddenLayer`` (``Linear(7, 3)``) or ``HiddenLayer2``
    (``Linear(3, 3)``), with its activation."""
    layers: list[nn.Module] = [nn.Linear(7, 3) if first else nn.Linear(3, 3)]
    return layers + ([act()] if act is not None else [])


def conv(act) -> list[nn.Module]:
    """``test_problems_convolutions.py``'s ``convlayer``: ``Conv2d(3, 3, (3, 2),
    padding=(1, 1))`` on ``[3, 4, 5]`` inputs, then its activation."""
    return [nn.Conv2d(3, 3, (3, 2), padding=(1, 1)), act()]


@dataclasses.dataclass
class Problem:
    """``test_problem.py``'s ``TestProblem``: ``loss(model(X), Y)``, its loss a mean over the
    batch."""

    model: nn.Module
    x: Tensor
    y: Tensor
    loss: object


def make_problem(kind: str, modules: list[nn.Module], input_shape: tuple) -> Problem:
    """``problems.py``: ``"regression"`` appends ``Flatten`` and a ``Linear(outputs, 1)``
    under ``MSELoss``; ``"classification"`` appends ``Flatten`` under ``CrossEntropyLoss``
    (labels below the output's width; for its convolutions, below the channels)."""
    x = torch.randn(*input_shape, dtype=D)
    body = nn.Sequential(*modules, nn.Flatten()).double()
    if kind == "regression":
        outputs = body(x).shape[1]
        model = nn.Sequential(*body, nn.Linear(outputs, 1).double())
        return Problem(model, x, torch.randn(len(x), 1, dtype=D), F.mse_loss)
    high = x.shape[1] if len(input_shape) > 2 else body(x).shape[1]
    return Problem(body, x, torch.randint(high, (len(x),)), F.cross_entropy)


def backpack_problem(name: str, batch: int = 5) -> Problem:
    """The problem ``name`` of ``test_problems_linear.py`` / ``..._activations.py``
    (``"linear-<act>-<kind>"``, inputs ``[batch, 7]``) or ``..._convolutions.py``
    (``"conv-<act>-<kind>"``, inputs ``[3, 3, 4, 5]``), seeded by its name."""
    torch.manual_seed(sum(map(ord, name)))
    family, act_name, kind = name.split("-")
    act = ACTIVATIONS[act_name]
    if family == "linear":
        modules = hidden(act) + (hidden(None, first=False) if kind == "2layer" else [])
        return make_problem("regression" if kind == "regression" else "classification",
                            modules, (batch, 7))  # fmt: skip
    modules = conv(act)
    if kind == "2layer":
        modules += conv(act)
    return make_problem("regression" if kind == "regression" else "classification",
                        modules, (3, 3, 4, 5))  # fmt: skip


PROBLEMS = [
    f"{family}-{act}-{kind}"
    for family, acts in (("linear", ACTIVATIONS), ("conv", ("relu", "sigmoid", "tanh")))
    for act in acts
    for kind in ("regression", "classification", "2layer")
]


@pytest.mark.parametrize("name", PROBLEMS)
def test_backpack_automated_first_order(name):
    """automated_test.py ``test_batch_gradients``, ``test_batch_gradients_sum_to_grad``,
    ``test_sgs``, ``test_batch_l2`` and ``test_variance`` on every problem of
    ``test_problems_linear.py``, ``..._activations.py`` and ``..._convolutions.py``: ``grad1``
    (BackPACK's ``grad_batch`` times the batch, its losses being means), its mean against
    ``.grad``, ``Σᵢ grad1ᵢ²``, each parameter's squared norms and the population variance
    against the per-example loop, from one backward asking for all of them."""
    p = backpack_problem(name)
    want = loop_grad(p.model, p.loss, p.x, p.y)
    with gradhooks.add_hooks(p.model, quantities=("grad1", "norms", "sum_grad_sq")) as h:
        p.loss(p.model(p.x), p.y).backward()
        assert_grad1(p.model, want, name)
        norms = h.param_norms()
        sgs = h.sum_grad_sq()
        variance = h.grad_variance()
    for n, param in p.model.named_parameters():
        assert_close(param.grad1.mean(0), param.grad, f"{name}: grad1 mean vs .grad, {n}")
        g = want[n]
        assert_close(sgs[n], (g**2).sum(0), f"{name}: sum_grad_sq {n}")
        assert_close(norms[n] ** 2, g.flatten(1).pow(2).sum(1), f"{name}: batch_l2 {n}")
        assert_close(variance[n], (g**2).mean(0) - g.mean(0) ** 2, f"{name}: variance {n}")


@pytest.mark.parametrize(
    "name", ["linear-tanh-2layer", "linear-relu-regression", "conv-relu-2layer",
             "conv-sigmoid-regression"],
)  # fmt: skip
def test_backpack_automated_first_order_under_bf16_autocast(name):
    """The same problems (automated_test.py ``test_batch_gradients``, ``test_batch_l2``) in a
    float32 model under CPU bfloat16 autocast: ``grad1`` within bfloat16's rounding (3e-2 of
    the largest entry) of the float64 loop's, each parameter's norms within 3e-2 relative,
    ``.grad`` within the batch's mean of those."""
    p = backpack_problem(name)
    want = loop_grad(p.model, p.loss, p.x, p.y)
    low = copy.deepcopy(p.model).float()
    with gradhooks.add_hooks(low, quantities=("grad1", "norms")) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = low(p.x.float())
        target = p.y.float() if p.y.is_floating_point() else p.y
        p.loss(out.float(), target).backward()
        norms = h.param_norms()
    scale = max(w.abs().max() for w in want.values())
    for n, param in low.named_parameters():
        torch.testing.assert_close(param.grad1.double() / scale, want[n] / scale, rtol=0,
                                   atol=3e-2, msg=lambda m, n=n: f"{name} {n}: {m}")  # fmt: skip
        torch.testing.assert_close(norms[n].double(), want[n].flatten(1).norm(dim=1), rtol=3e-2,
                                   atol=1e-3 * scale.item())  # fmt: skip
        torch.testing.assert_close(param.grad.double() / scale, want[n].mean(0) / scale, rtol=0,
                                   atol=3e-2)  # fmt: skip


def ggn_reference(p: Problem) -> Tensor:
    """``[P, P]``: the GGN of the batch's mean loss, ``Jᵀ H J`` with ``J`` the Jacobian of the
    whole batch's flattened output in the flattened parameters and ``H`` the loss's Hessian in
    that output (``torch.autograd.functional``)."""
    names = [n for n, _ in p.model.named_parameters()]
    shapes = [q.shape for q in p.model.parameters()]
    flat = torch.cat([q.detach().flatten() for q in p.model.parameters()])

    def output(theta: Tensor) -> Tensor:
        pieces = theta.split([s.numel() for s in shapes])
        values = {n: v.reshape(s) for n, v, s in zip(names, pieces, shapes)}
        return torch.func.functional_call(p.model, values, (p.x,)).flatten()

    z = output(flat).detach()
    J = torch.autograd.functional.jacobian(output, flat)
    H = torch.autograd.functional.hessian(lambda o: p.loss(o.view(len(p.x), -1), p.y), z)
    return J.T @ H @ J


def ggn_from_jacobians(p: Problem) -> Tensor:
    """``[P, P]``: ``(1/N) Σᵢ Jᵢᵀ Hᵢ Jᵢ`` from gradhooks' per-example Jacobians ``Jᵢ`` and each
    example's loss Hessian in its own output."""
    J = gradhooks.jacobians(p.model, p.x, flatten=True)  # [N, C, P]
    out = p.model(p.x).detach()
    ggn = torch.zeros(J.shape[-1], J.shape[-1], dtype=D)
    for i in range(len(p.x)):
        H = torch.autograd.functional.hessian(
            lambda o, i=i: p.loss(o, p.y[i : i + 1]), out[i : i + 1]
        )
        H = H.reshape(out.shape[1], out.shape[1])
        ggn += J[i].T @ H @ J[i]
    return ggn / len(p.x)


@pytest.mark.parametrize(
    "name", ["linear-sigmoid-2layer", "linear-tanh-regression", "conv-relu-2layer",
             "conv-tanh-regression"],
)  # fmt: skip
def test_backpack_automated_ggn_matrix_product(name):
    """automated_test.py ``test_ggn_mp`` and ``test_ggn_vp``: the GGN of the mean loss times
    10 random columns (and one vector), the GGN formed from gradhooks' per-example Jacobians
    (``gradhooks.jacobians``) against ``Jᵀ H J`` of the whole batch by autograd."""
    p = backpack_problem(name)
    ggn = ggn_from_jacobians(p)
    want = ggn_reference(p)
    columns = torch.randn(want.shape[0], 10, dtype=D)
    assert_close(ggn @ columns, want @ columns, f"{name}: GGN times 10 columns")
    assert_close(ggn @ columns[:, 0], want @ columns[:, 0], f"{name}: GGN times a vector")


@pytest.mark.parametrize("name", PROBLEMS)
def test_backpack_automated_diag_ggn_blocks(name):
    """automated_test.py ``test_diag_ggn`` on every problem (sigmoid and tanh too, where the
    GGN is not the Hessian): autograd-hacks' ``backprop_hess`` / ``compute_hess``
    (:func:`gradhooks.compute_hess`), whose ``param.hess`` is the parameter's whole GGN block of
    the mean loss, against the block of ``Jᵀ H J`` (its diagonal BackPACK's ``DiagGGNExact``);
    ``"LeastSquares"`` is half the squared error, so ``MSELoss``'s block is twice it."""
    p = backpack_problem(name)
    want = ggn_reference(p)
    regression = p.loss is F.mse_loss
    with gradhooks.add_hooks(p.model):
        out = p.model(p.x)
        gradhooks.backprop_hess(out, hess_type="LeastSquares" if regression else "CrossEntropy")
        gradhooks.compute_hess(p.model)
    start = 0
    for n, param in p.model.named_parameters():
        end = start + param.numel()
        block = want[start:end, start:end]
        assert_close(param.hess * (2 if regression else 1), block, f"{name}: GGN block of {n}")
        assert_close(param.hess.diagonal() * (2 if regression else 1), block.diagonal(),
                     f"{name}: diagonal GGN of {n}")  # fmt: skip
        start = end


BN_PROBLEMS = ["regression", "classification", "2layer"]


def bn_problem(kind: str) -> Problem:
    """``test_problems_bn.py``: the Linear problems with a ``BatchNorm1d(3)`` after the
    hidden layers."""
    torch.manual_seed(len(kind))
    modules = hidden(None) + (hidden(None, first=False) if kind == "2layer" else [])
    modules.append(nn.BatchNorm1d(3))
    return make_problem("regression" if kind == "regression" else "classification",
                        modules, (5, 7))  # fmt: skip


@pytest.mark.parametrize("kind", BN_PROBLEMS)
def test_backpack_automated_batch_norm_problems(kind):
    """automated_test.py ``test_batch_gradients_sum_to_grad`` on ``test_problems_bn.py``
    (BackPACK checks only that its batch gradients sum to ``.grad``: in training a BatchNorm
    normalizes each example by the batch's statistics, and no example has a gradient of its
    own): refused with ``MixedExamplesError``, nothing written; in eval, with running
    statistics of its own, the loop's."""
    p = bn_problem(kind)
    before = model_state(p.model)
    with pytest.raises(gradhooks.MixedExamplesError):
        with gradhooks.add_hooks(p.model):
            p.loss(p.model(p.x), p.y).backward()
    p.model.zero_grad(set_to_none=True)
    assert_untouched(p.model, before)
    with pytest.raises(gradhooks.MixedExamplesError):
        gradhooks.jacobians(p.model, p.x)

    bn = next(m for m in p.model if isinstance(m, nn.BatchNorm1d))
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    nn.init.uniform_(bn.weight, 0.5, 1.5)
    p.model.eval()
    want = loop_grad(p.model, p.loss, p.x, p.y)
    with gradhooks.add_hooks(p.model):
        p.loss(p.model(p.x), p.y).backward()
    assert_grad1(p.model, want, f"BatchNorm {kind} in eval")
    for n, param in p.model.named_parameters():
        assert_close(param.grad1.mean(0), param.grad, f"BatchNorm {kind}: mean vs .grad, {n}")


# == BackPACK: automated_kfac_test.py (one datum) ===============================================

KFAC_PROBLEMS = [
    f"linear-{act}-{kind}"
    for act in ("relu", "sigmoid", "tanh")
    for kind in ("regression", "classification", "2layer")
]


def lossname(p: Problem) -> str:
    return "mse" if p.loss is F.mse_loss else "cross_entropy"


@pytest.mark.parametrize("name", KFAC_PROBLEMS)
def test_backpack_kflr_equals_ggn_for_one_datum(name):
    """automated_kfac_test.py ``test_kflr_should_equal_ggn`` on ``test_problems_kfacs.py``
    (its problems on a batch of one): for one datum, every Linear's ``kron(G, A)`` of
    ``fisher="exact"`` is its GGN block, ``Jᵀ (Σ_k c_k c_kᵀ) J`` with ``c_k`` the columns of
    the loss Hessian's square root and ``J`` the Jacobian of the output in the layer's
    ``[W | b]``."""
    p = backpack_problem(name, batch=1)
    kind = lossname(p)
    factors = gradhooks.kfac(p.model, p.x, p.y, fisher="exact", loss=kind, reduction="sum")
    columns = loss_hessian_columns(p.model(p.x), p.y, kind, "exact")
    layers = [(n, m) for n, m in p.model.named_modules() if isinstance(m, nn.Linear)]
    for n, layer in layers:
        f = factors[f"{n}.weight"]
        want = layer_fisher(p.model, layer, p.x, columns)
        assert_close(torch.kron(f.G, f.A), want, f"{name}: GGN block of {n}")
    assert set(factors) == {f"{n}.weight" for n, _ in layers}


@pytest.mark.parametrize("name", ["linear-sigmoid-classification", "linear-tanh-2layer",
                                  "linear-relu-regression"])  # fmt: skip
def test_backpack_kfac_monte_carlo_approximates_ggn(name):
    """automated_kfac_test.py ``test_kfac_should_approx_ggn_montecarlo`` (marked
    ``montecarlo`` there): for one datum, the factors of ``fisher="mc"`` averaged over 2000
    sampled backwards approach the GGN block, at the peer's ``atol = rtol = 0.1``."""
    p = backpack_problem(name, batch=1)
    kind = lossname(p)
    g = torch.Generator().manual_seed(0)
    factors = gradhooks.kfac(p.model, p.x, p.y, fisher="mc", loss=kind, reduction="sum",
                             mc_samples=2000, generator=g)  # fmt: skip
    columns = loss_hessian_columns(p.model(p.x), p.y, kind, "exact")
    for n, layer in p.model.named_modules():
        if isinstance(layer, nn.Linear):
            f = factors[f"{n}.weight"]
            want = layer_fisher(p.model, layer, p.x, columns)
            torch.testing.assert_close(torch.kron(f.G, f.A), want, atol=0.1, rtol=0.1)


# == BackPACK: linear_test.py, conv2d_test.py ===================================================


def sum_of_squares(out: Tensor) -> Tensor:
    """The peers' ``loss_function``: the sum of the squared entries."""
    return out.reshape(-1).pow(2).sum()


@pytest.mark.parametrize("example", [0, 1])
def test_backpack_linear_examples(example):
    """linear_test.py ``test_grad``, ``test_grad_batch``: ``Linear(3, 2)`` with weight
    ``[[1, 2, 3], [4, 5, 6]]`` and bias ``[7, 8]`` on its ``EXAMPLE_1`` (one input of ones) and
    ``EXAMPLE_2`` (two 0/1 inputs), under the sum of squares: ``grad1`` of the weight is the
    closed form ``2·out ⊗ x`` and of the bias ``2·out``, and sums to ``.grad``."""
    layer = nn.Linear(3, 2).double()
    with torch.no_grad():
        layer.weight.copy_(torch.arange(1.0, 7.0).view(2, 3))
        layer.bias.copy_(torch.tensor([7.0, 8.0]))
    x = (
        torch.ones(1, 3, dtype=D)
        if example == 0
        else torch.tensor([[1, 0, 1], [0, 1, 0.0]], dtype=D)
    )
    with gradhooks.add_hooks(layer, loss_reduction="sum"):
        out = layer(x)
        sum_of_squares(out).backward()
    out = out.detach()
    assert_close(layer.weight.grad1, 2 * out[:, :, None] * x[:, None, :], "weight grad_batch")
    assert_close(layer.bias.grad1, 2 * out, "bias grad_batch")
    assert_close(layer.weight.grad1.sum(0), layer.weight.grad, "weight grad")
    assert_close(layer.bias.grad1.sum(0), layer.bias.grad, "bias grad")


def chellapilla() -> tuple[nn.Conv2d, Tensor]:
    """conv2d_test.py's example from Chellapilla et al. (2006): ``Conv2d(3, 2, 2)`` without bias,
    its integer kernel, on one 3x3 image of 3 channels (here with a second image, the first
    reversed)."""
    layer = nn.Conv2d(3, 2, 2, bias=False).double()
    kernel = [[[[1, 1], [2, 2]], [[1, 1], [1, 1]], [[0, 1], [1, 0]]],
              [[[1, 0], [0, 1]], [[2, 1], [2, 1]], [[1, 2], [2, 0]]]]  # fmt: skip
    image = [[[1, 2, 0], [1, 1, 3], [0, 2, 2]], [[0, 2, 1], [0, 3, 2], [1, 1, 0]],
             [[1, 2, 1], [0, 1, 3], [3, 3, 2]]]  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(kernel, dtype=D))
    x = torch.tensor([image], dtype=D)
    return layer, torch.cat([x, x.flip(-1, -2)])


def random_convolution(seed: int) -> tuple[nn.Conv2d, Tensor]:
    """conv2d_test.py's ``random_convolutions_and_inputs(bias=True)``: channels 1-3, kernel,
    stride and dilation 1-3, padding 0-2, a batch of 1-3 images of 8-12 pixels a side, all
    drawn (by ``random.Random(seed)``)."""
    r = random.Random(seed)
    cin, cout = r.randint(1, 3), r.randint(1, 3)
    kernel, stride = (r.randint(1, 3), r.randint(1, 3)), (r.randint(1, 3), r.randint(1, 3))
    padding, dilation = (r.randint(0, 2), r.randint(0, 2)), (r.randint(1, 3), r.randint(1, 3))
    batch, size = r.randint(1, 3), (r.randint(8, 12), r.randint(8, 12))
    torch.manual_seed(seed)
    layer = nn.Conv2d(cin, cout, kernel, stride, padding, dilation).double()
    return layer, torch.randn(batch, cin, *size, dtype=D)


@pytest.mark.parametrize("seed", ["chellapilla", 0, 1, 2, 3, 4, 5])
def test_backpack_conv2d(seed):
    """conv2d_test.py ``test_random_grad``, ``test_random_grad_batch`` (skipped by the peer:
    ``"Test does not consistently fail or pass"`` at its float32 ``atol=1e-4``) and its
    Chellapilla example, under the sum of squares: ``grad1`` of the weight against each
    example's ``torch.nn.grad.conv2d_weight`` of ``2·out``, of the bias against ``2·out``
    summed over the pixels, both against the loop, and summed to ``.grad``."""
    layer, x = chellapilla() if seed == "chellapilla" else random_convolution(seed)
    want = loop_grad(layer, sum_of_squares, x)
    with gradhooks.add_hooks(layer, loss_reduction="sum"):
        out = layer(x)
        sum_of_squares(out).backward()
    assert_grad1(layer, want, f"conv {seed}")
    out = out.detach()
    for i in range(len(x)):
        w = torch.nn.grad.conv2d_weight(
            x[i : i + 1], layer.weight.shape, 2 * out[i : i + 1], layer.stride, layer.padding,
            layer.dilation,
        )  # fmt: skip
        assert_close(layer.weight.grad1[i], w, f"conv {seed}: conv2d_weight of example {i}")
        if layer.bias is not None:
            assert_close(layer.bias.grad1[i], 2 * out[i].sum((1, 2)), f"conv {seed}: bias {i}")
    for n, p in layer.named_parameters():
        assert_close(p.grad1.sum(0), p.grad, f"conv {seed}: grad1 sum vs .grad, {n}")


# == BackPACK: extensions/test_hooks.py, test_second_order_warnings.py ==========================


class CustomContainer(nn.Module):
    """test_hooks.py's ``_MyCustomModule``: two bias-free Linears called in its forward."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(4, 3, bias=False)
        self.linear2 = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.linear2(self.linear1(x))


def container(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "nested_sequential":
        return nn.Sequential(nn.Linear(4, 3, bias=False),
                             nn.Sequential(nn.Linear(3, 2, bias=False))).double()  # fmt: skip
    return CustomContainer().double()


@pytest.mark.parametrize("kind", ["nested_sequential", "custom_container"])
def test_backpack_extension_hooks_on_containers(kind):
    """test_hooks.py ``test_extension_hook_multiple_parameter_visits`` and
    ``test_extension_hook_param_before_savefield_exists`` (BackPACK visits a custom container's
    parameters twice, and refuses ``DiagGGNExact`` there): on both, under ``CrossEntropyLoss``
    of a batch of 2 from ``rand``, every parameter gets its ``grad1`` (the loop's) from the one
    backward, the diagonal GGN from the per-example Jacobians is autograd's, and K-FAC has
    factors for both Linears, the same for the two containers."""
    torch.manual_seed(0)
    x, y = torch.rand(2, 4, dtype=D), torch.randint(2, (2,))
    model = container(kind)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, kind)
    p = Problem(model, x, y, F.cross_entropy)
    assert_close(ggn_from_jacobians(p).diagonal(), ggn_reference(p).diagonal(), f"{kind}: diag GGN")

    factors = gradhooks.kfac(model, x, y, fisher="exact")
    twin = container("nested_sequential" if kind == "custom_container" else "custom_container")
    twin.load_state_dict(dict(zip(twin.state_dict(), model.state_dict().values())))
    other = gradhooks.kfac(twin, x, y, fisher="exact")
    assert len(factors) == len(other) == 2
    for (n, f), (m, g) in zip(factors.items(), other.items()):
        assert_close(f.A, g.A, f"{kind}: A of {n} vs {m}")
        assert_close(f.G, g.G, f"{kind}: G of {n} vs {m}")


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
def test_backpack_second_order_modified_loss(lossname):
    """test_second_order_warnings.py ``test_sqrt_hessian_modified_crossentropy_should_fail``
    and ``..._mse_should_fail``: the loss module's output multiplied by 2 (BackPACK's second
    order backpropagates the module's own Hessian, so it warns). ``grad1`` of ``2·loss`` is
    twice the loop's of ``loss``; given to :func:`gradhooks.kfac` as a function, ``2·loss``
    scales the exact ``G`` by 2 (its Hessian) and the empirical ``G`` by 4 (its gradient's
    outer product), ``A`` unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.rand(5, 4, dtype=D)
    if lossname == "cross_entropy":
        y, base = torch.randint(2, (5,)), F.cross_entropy
    else:
        y, base = torch.randn(5, 2, dtype=D), F.mse_loss

    def doubled(o, t):
        return 2 * base(o, t)

    want = loop_grad(model, base, x, y)
    with gradhooks.add_hooks(model):
        doubled(model(x), y).backward()
    assert_grad1(model, {n: 2 * g for n, g in want.items()}, f"2 · {lossname}")
    gradhooks.clear_grad1(model)

    for fisher, scale in (("exact", 2.0), ("empirical", 4.0)):
        plain = gradhooks.kfac(model, x, y, fisher=fisher, loss=base)
        scaled = gradhooks.kfac(model, x, y, fisher=fisher, loss=doubled)
        for n, f in plain.items():
            assert_close(scaled[n].A, f.A, f"{lossname} {fisher}: A of {n}")
            assert_close(scaled[n].G, scale * f.G, f"{lossname} {fisher}: G of {n}")


# == torch: test/test_expanded_weights.py, test_embedding_one / test_embedding_two ==============

EMBEDDING_KWARGS = {
    "one": dict(max_norm=1.0, padding_idx=0),
    "two": dict(max_norm=1.0, padding_idx=0, scale_grad_by_freq=True),
    "two_sparse": dict(max_norm=1.0, padding_idx=0, sparse=True),
}


@pytest.mark.parametrize("setting", EMBEDDING_KWARGS)
def test_expanded_weights_embedding_renormalized_in_forward(setting):
    """test_expanded_weights.py ``test_embedding_one`` and ``test_embedding_two``: an
    ``Embedding(5, 5)`` whose rows (``randn + 2``) are longer than ``max_norm=1``, so that its
    forward renormalizes them in place, with ``padding_idx=0``, on ``[3, 3]`` indices (torch
    refuses ``sparse`` with ``scale_grad_by_freq``, so the peer's second setting is split in
    two). Under the hooks the forward and the renormalized table are those of a twin without
    them; ``grad1`` of the summed squares is the loop's (each example's rows renormalized by
    its own forward). With ``scale_grad_by_freq`` each example's gradient is scaled by its own
    counts, so ``grad1`` does not sum to ``.grad`` (scaled by the batch's), and the DP step
    refuses the layer (``UnsupportedError``, nothing written)."""
    kw = EMBEDDING_KWARGS[setting]
    torch.manual_seed(0)
    emb = nn.Embedding(5, 5, **kw).double()
    with torch.no_grad():
        emb.weight.copy_(torch.randn(5, 5, dtype=D) + 2)
    idx = torch.randint(5, (3, 3))
    twin, reference = copy.deepcopy(emb), copy.deepcopy(emb)
    want = loop_grad(reference, sum_of_squares, idx)
    with gradhooks.add_hooks(emb, loss_reduction="sum"):
        out = emb(idx)
        sum_of_squares(out).backward()
    assert torch.equal(out, twin(idx)), "the forward changed under the hooks"
    assert torch.equal(emb.weight, twin.weight) and torch.equal(emb.weight, reference.weight)
    assert_grad1(emb, want, f"embedding {setting}")
    summed = torch.allclose(emb.weight.grad1.sum(0), emb.weight.grad.to_dense())
    assert summed != kw.get("scale_grad_by_freq", False), f"embedding {setting}: grad1 sum"
    if kw.get("scale_grad_by_freq"):
        emb.zero_grad(set_to_none=True)
        gradhooks.clear_grad1(emb)
        before = model_state(emb)
        with gradhooks.add_hooks(emb) as h:
            losses = emb(idx).pow(2).flatten(1).sum(1)
            with pytest.raises(gradhooks.UnsupportedError):
                gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
        assert_untouched(emb, before)


# == Opacus: benchmarks/layers.py, benchmarks/tests/test_layers.py ===============================

BATCH, SOURCE, TARGET = 4, 7, 5


def soft_cross_entropy(out: Tensor, labels: Tensor) -> Tensor:
    """The benchmarks' criterion, ``F.cross_entropy`` against soft targets drawn from
    ``randn`` of the output's shape: classes on dimension 1."""
    return F.cross_entropy(out, labels)


def benchmark_layer(name: str, batch_first: bool):
    """``(layer, inputs, labels, batch_dim)`` as ``LayerFactory.create(name)`` builds them,
    smaller: the inputs ``randn`` (indices for the embedding), RNNs without bias from a
    ``randn`` initial state ``[layers, batch, hidden]`` (and cell), attention with a key and
    value of ``SOURCE`` steps and a query of ``TARGET``."""
    torch.manual_seed(sum(map(ord, name)))
    b = BATCH
    if name == "linear":
        return nn.Linear(6, 6), (torch.randn(b, 6),), torch.randn(b, 6), 0
    if name == "conv":
        layer = nn.Conv2d(3, 4, 3)
        return layer, (torch.randn(b, 3, 5, 9),), torch.randn(b, 4, 3, 7), 0
    if name == "layernorm":
        return nn.LayerNorm(8), (torch.randn(b, 8),), torch.randn(b, 8), 0
    if name == "instancenorm":
        layer = nn.InstanceNorm1d(6, affine=True)
        return layer, (torch.randn(b, 6, 8),), torch.randn(b, 6, 8), 0
    if name == "groupnorm":
        return nn.GroupNorm(4, 16), (torch.randn(b, 16),), torch.randn(b, 16), 0
    if name == "embedding":
        layer = nn.Embedding(50, 6)
        return layer, (torch.randint(50, (b, 5)),), torch.randn(b, 5, 6), 0
    first = (lambda *s: torch.randn(b, *s)) if batch_first else (lambda t, e: torch.randn(t, b, e))
    dim = 0 if batch_first else 1
    if name in ("mha", "dpmha"):
        cls = nn.MultiheadAttention if name == "mha" else opacus_layers().DPMultiheadAttention
        layer = cls(6, 2, batch_first=batch_first)
        key = first(SOURCE, 6)
        return layer, (first(TARGET, 6), key, key.clone()), first(TARGET, 6), dim
    torch_cls = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}
    if name in torch_cls:
        cls = torch_cls[name]
    else:
        cls = getattr(opacus_layers(), name.upper())
    layer = cls(3, 4, bias=False, batch_first=batch_first)
    state = torch.randn(1, b, 4)
    if "lstm" in name:
        state = (state, torch.randn(1, b, 4))
    return layer, (first(TARGET, 3), state), first(TARGET, 4), dim


def output_of(out):
    """``forward_only``: the first output of a layer that returns a tuple."""
    return out[0] if isinstance(out, tuple) else out


def per_example_call(layer: nn.Module, args: tuple, i: int, batch_dim: int, recurrent: bool):
    """``layer`` on example ``i`` alone: its slice of each input along ``batch_dim`` (a
    recurrent layer's initial state with its batch on dimension 1, whatever the layout)."""

    def one(a):
        if isinstance(a, tuple):
            return tuple(one(s) for s in a)
        return a.narrow(batch_dim, i, 1)

    def state(a):
        if isinstance(a, tuple):
            return tuple(state(s) for s in a)
        return a.narrow(1, i, 1)

    x, *rest = args
    return layer(one(x), *(state(r) if recurrent else one(r) for r in rest))


def class_axis_first(out: Tensor, batch_dim: int) -> Tensor:
    """The output with the examples first: the classes of the criterion on dimension 1 are then
    the time steps (batch-first) or the features (a time-major output, whose dimension 1 is
    the batch, put batch-first)."""
    return out.movedim(batch_dim, 0)


BENCHMARKED = ["linear", "conv", "layernorm", "instancenorm", "groupnorm", "embedding"]
SEQUENTIAL = ["mha", "dpmha", "rnn", "dprnn", "gru", "dpgru", "lstm", "dplstm"]


def doubled_inputs(args: tuple) -> tuple:
    return tuple(
        tuple(s.double() for s in a) if isinstance(a, tuple)
        else a.double() if a.is_floating_point() else a
        for a in args
    )  # fmt: skip


def benchmark_loop(layer, args, labels, batch_dim: int, recurrent: bool) -> dict[str, Tensor]:
    """``{name: [batch, *shape]}``: each example's own soft-target cross-entropy through
    autograd, one example at a time."""
    rows: dict[str, list[Tensor]] = {}
    for i in range(BATCH):
        layer.zero_grad()
        out = per_example_call(layer, args, i, batch_dim, recurrent)
        soft_cross_entropy(
            class_axis_first(output_of(out), batch_dim), labels[i : i + 1]
        ).backward()
        for n, p in layer.named_parameters():
            rows.setdefault(n, []).append(p.grad.clone())
    layer.zero_grad(set_to_none=True)
    return {n: torch.stack(g) for n, g in rows.items()}


BENCHMARK_CASES = [(n, True) for n in BENCHMARKED] + [
    (n, bf) for n in SEQUENTIAL for bf in (True, False)
]


@pytest.mark.parametrize("name, batch_first", BENCHMARK_CASES)
def test_opacus_benchmark_layers(name, batch_first):
    """benchmarks/tests/test_layers.py ``test_forward_backward`` over its ``PARAMETERS`` (the
    layers of ``benchmarks/layers.py``, with ``batch_size`` 4 and smaller widths): the layer's
    ``forward_backward`` (the soft-target cross-entropy of its first output, then
    ``zero_grad``) under the hooks leaves its parameters as they were, and ``grad1`` is the
    loop's. A time-major output ``[T, batch, H]`` is put batch-first for the criterion (the
    benchmark's own call on it would take the softmax across the batch, a loss no example has
    alone)."""
    layer, args, labels, batch_dim = benchmark_layer(name, batch_first)
    layer, args = layer.double(), doubled_inputs(args)
    labels = class_axis_first(labels.double(), batch_dim)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    want = benchmark_loop(layer, args, labels, batch_dim, name in SEQUENTIAL[2:])

    with gradhooks.add_hooks(layer, batch_dim=batch_dim):
        out = class_axis_first(output_of(layer(*args)), batch_dim)
        soft_cross_entropy(out, labels).backward()
        assert_grad1(layer, want, f"{name} (batch_first={batch_first})")
        for n, p in layer.named_parameters():
            assert_close(p.grad1.mean(0), p.grad, f"{name}: grad1 mean vs .grad, {n}")
        layer.zero_grad()
    for n, p in layer.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{name}: {n} changed"
        assert p.grad is None, f"{name}: {n} kept a .grad after zero_grad"


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (Opacus' hooks, inputs)
@pytest.mark.parametrize("name, batch_first", BENCHMARK_CASES)
def test_opacus_benchmark_layers_clipped_step(name, batch_first):
    """The benchmarks' ``make_private`` (``wrap_model`` in ``grad_sample_mode="hooks"``) and
    step, for each benchmarked layer: the DP step (bound the median per-example norm, so that
    half the examples are clipped; no noise) by every method equals the loop's clipped mean;
    where Opacus' ``GradSampleModule`` takes the layer as it is (not torch's attention and
    RNNs, which its validator replaces), its ``grad_sample`` is gradhooks' ``grad1``."""
    layer, args, labels, batch_dim = benchmark_layer(name, batch_first)
    layer, args = layer.double(), doubled_inputs(args)
    labels = class_axis_first(labels.double(), batch_dim)
    want = benchmark_loop(layer, args, labels, batch_dim, name in SEQUENTIAL[2:])
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    bound = float(norms.median())
    factors = (bound / norms).clamp(max=1.0)
    assert (factors < 1).any() and (factors == 1).any(), "the bound clips some examples, not all"
    clipped = {n: torch.einsum("b,b...->...", factors, g) / BATCH for n, g in want.items()}

    for method in ("grad1", "ghost", "bookkeeping"):
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(layer, quantities=quantities, batch_dim=batch_dim) as h:
            out = class_axis_first(output_of(layer(*args)), batch_dim)
            losses = F.cross_entropy(out, labels, reduction="none").reshape(BATCH, -1).mean(1)
            got = gradhooks.dp_sgd_step(h, losses, max_norm=bound, noise_multiplier=0.0,
                                        method=method)  # fmt: skip
        assert_close(got, norms, f"{name} by {method}: norms")
        for n, p in layer.named_parameters():
            assert_close(p.grad, clipped[n], f"{name} by {method}: clipped mean, {n}")
        gradhooks.clear_grad1(layer)
        layer.zero_grad(set_to_none=True)

    if name in ("mha", "rnn", "gru", "lstm"):
        return
    opacus = pytest.importorskip("opacus", reason="needs opacus")
    theirs = copy.deepcopy(layer)
    gsm = opacus.GradSampleModule(theirs, batch_first=batch_first, loss_reduction="mean")
    # (Opacus' embedding sampler sets torch.backends.cudnn.deterministic, which torch refuses
    # once its internal test utilities, imported by other test files in this process, froze
    # the flags: allowed for the backward, as torch's own tests do)
    mutable = getattr(torch.backends, "__allow_nonbracketed_mutation", contextlib.nullcontext)
    try:
        with mutable():
            out = class_axis_first(output_of(gsm(*args)), batch_dim)
            soft_cross_entropy(out, labels).backward()
        samples = {n: p.grad_sample for n, p in theirs.named_parameters()}
    finally:
        gsm._close()  # (which deletes grad_sample)
    for n, g in samples.items():
        assert_close(g, want[n], f"{name}: Opacus' grad_sample vs the loop, {n}")


# == Opacus: validators/batch_norm_test.py ======================================================

NORMS = {
    "BatchNorm1d": (nn.BatchNorm1d, (5, 4, 3)),
    "BatchNorm2d": (nn.BatchNorm2d, (5, 4, 3, 3)),
    "BatchNorm3d": (nn.BatchNorm3d, (5, 4, 2, 3, 3)),
    "SyncBatchNorm": (nn.SyncBatchNorm, (5, 4, 3, 3)),
}


@pytest.mark.parametrize("name", NORMS)
def test_opacus_batch_norm_validator(name):
    """batch_norm_test.py ``test_validate`` and ``test_fix``: each batch norm of 4 channels
    (``SyncBatchNorm`` too, which normalizes by the batch's statistics outside a process
    group) after a Linear over its channels, in training, refused with ``MixedExamplesError``,
    nothing written; :func:`gradhooks.convert_batch_norm` turns it into a ``GroupNorm`` (the
    fixer's), whose ``grad1`` is the loop's."""
    cls, shape = NORMS[name]
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(4, 4), cls(4)

        def forward(self, x):
            return self.norm(self.fc(x.movedim(1, -1)).movedim(-1, 1))

    model = Net().double()
    x = torch.randn(*shape, dtype=D)
    before = model_state(model)
    with pytest.raises(gradhooks.MixedExamplesError):
        with gradhooks.add_hooks(model):
            sum_of_squares(model(x)).backward()
    model.zero_grad(set_to_none=True)
    assert_untouched(model, before)

    gradhooks.convert_batch_norm(model)
    assert type(model.norm) is nn.GroupNorm and model.norm.num_channels == 4
    want = loop_grad(model, sum_of_squares, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sum_of_squares(model(x)).backward()
    assert_grad1(model, want, f"{name} converted")


# == Opacus: multigpu_precision_test.py, mixed_precision_utils.py ===============================


class SimpleLinearReluModel(nn.Module):
    """``mixed_precision_utils.py``'s model: Linear-LayerNorm-ReLU-Linear (4 -> 32 -> 4)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln1, self.fc2 = nn.Linear(4, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.ln1(self.fc1(x))))


class EmbeddingModel(nn.Module):
    """``mixed_precision_utils.py``'s ``EmbeddingModel``: an Embedding of 100 rows, LayerNorm,
    the mean over the 10 tokens, ReLU, a Linear to 4 classes."""

    def __init__(self):
        super().__init__()
        self.embedding, self.layer_norm = nn.Embedding(100, 16), nn.LayerNorm(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(F.relu(self.layer_norm(self.embedding(x)).mean(1)))


def clipped_mean(per: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
    factors = (bound / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factors, g) / len(norms) for n, g in per.items()}


@pytest.mark.parametrize("method", ["grad1", "ghost"])
@pytest.mark.parametrize("precision", ["mixed", "low"])
@pytest.mark.parametrize("model_class", [SimpleLinearReluModel, EmbeddingModel])
def test_opacus_precision_dtypes(model_class, precision, method):
    """multigpu_precision_test.py ``run_mixed_precision_test`` and ``run_low_precision_test``
    (one process here, its batches of 2, ``hooks`` and ``ghost`` modes as gradhooks' methods):
    mixed precision (a float32 model under bfloat16 autocast) gives bfloat16 outputs and
    float32 ``.grad``, ``grad1`` and norms; low precision (the model in bfloat16) gives bfloat16
    outputs, ``.grad`` and ``grad1``. The step (bound 1, no noise) is the float64 loop's
    clipped mean within bfloat16's rounding (5e-2 of the largest entry; the norms 5e-2
    relative)."""
    torch.manual_seed(0)
    model = model_class()
    if model_class is EmbeddingModel:
        x = torch.randint(100, (2, 10))
    else:
        x = torch.randn(2, 4)
    y = torch.randint(4, (2,))
    reference = copy.deepcopy(model).double()
    want = loop_grad(reference, F.cross_entropy, x.double() if x.is_floating_point() else x, y)
    norms_want = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    step_want = clipped_mean(want, 1.0)

    low = precision == "low"
    dtype = torch.bfloat16 if low else torch.float32
    if low:
        model = model.to(torch.bfloat16)
        x = x.bfloat16() if x.is_floating_point() else x
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not low):
            out = model(x)
        assert out.dtype == torch.bfloat16
        losses = F.cross_entropy(out, y, reduction="none")
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms.double(), norms_want, rtol=5e-2, atol=1e-3)
    scale = max(g.abs().max() for g in step_want.values())
    for n, p in model.named_parameters():
        assert p.dtype == dtype and p.grad.dtype == dtype, n
        if method == "grad1":
            assert p.grad1.dtype == dtype, n
        torch.testing.assert_close(p.grad.double() / scale, step_want[n] / scale, rtol=0,
                                   atol=5e-2, msg=lambda m, n=n: f"{n}: {m}")  # fmt: skip


# == ASDL: grad_maker/test_grad_maker.py =========================================================


class NetworkA(nn.Module):
    """ASDL's ``NetworkA`` (``network_type="mlp"``): Linear-ReLU-Linear-ReLU-Linear (5, 4, 3);
    given targets, it returns ``(logits, loss)``, or ``(loss, logits)`` with ``flip``, its loss
    the batch's mean cross-entropy."""

    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(),
                                   nn.Linear(4, 3))  # fmt: skip

    def forward(self, inputs, targets=None, flip=False):
        logits = self.model(inputs)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits, targets)
        return (loss, logits) if flip else (logits, loss)


@dataclasses.dataclass
class Output:
    loss: Tensor | None
    logits: Tensor


class NetworkB(NetworkA):
    """ASDL's ``NetworkB``: the same MLP on ``[batch, seq, 5]``; with targets ``[batch, seq]``,
    the cross-entropy of the flattened tokens, ``ignore_index=-1``; an ``Output`` or, with
    ``return_dict=False``, ``(loss, logits)``."""

    def forward(self, inputs, targets=None, return_dict=True):
        logits = self.model(inputs)
        loss = None
        if targets is not None:
            flat = logits.view(-1, logits.size(-1))
            loss = F.cross_entropy(flat, targets.view(-1), ignore_index=-1)
        return Output(loss, logits) if return_dict else (loss, logits)


@pytest.mark.parametrize("returns", ["logits", "tuple", "flipped"])
def test_asdl_grad_maker_network_a(returns):
    """test_grad_maker.py ``test_logits`` and ``test_tuple`` (``GradientMaker`` given the
    model's call and its loss, or the loss the model returns, on a batch of 2): ``grad1`` of the
    loss computed outside the model, or inside its forward and returned with the logits, is the
    loop's of the outside cross-entropy."""
    torch.manual_seed(0)
    model = NetworkA().double()
    x, t = torch.randn(2, 5, dtype=D), torch.randint(3, (2,))
    want = loop_grad(model, F.cross_entropy, x, t)
    with gradhooks.add_hooks(model):
        if returns == "logits":
            loss = F.cross_entropy(model(x), t)
        elif returns == "tuple":
            loss = model(x, t)[1]
        else:
            loss = model(x, t, flip=True)[0]
        loss.backward()
    assert_grad1(model, want, f"NetworkA returning {returns}")


@pytest.mark.parametrize("return_dict", [True, False])
def test_asdl_grad_maker_sequence_ignore_index(return_dict):
    """test_grad_maker.py ``test_sequence_output`` and ``test_sequence_tuple``: ``NetworkB`` on
    a batch of 2 sequences of 8 tokens, targets from ``randint(-1, 3)`` (``-1`` ignored). The
    loss is a mean over the batch's counted tokens ``N``, a number common to every example:
    under ``loss_reduction="sum"``, ``grad1[i]`` is the gradient of example ``i``'s summed
    token losses divided by ``N``, and sums to ``.grad``."""
    torch.manual_seed(0)
    model = NetworkB().double()
    x, t = torch.randn(2, 8, 5, dtype=D), torch.randint(-1, 3, (2, 8))
    t[0, 0], t[1, 1] = -1, -1
    counted = int((t != -1).sum())

    def own(out, target):
        flat = out.logits.reshape(-1, out.logits.size(-1))
        return F.cross_entropy(flat, target.view(-1), ignore_index=-1, reduction="sum") / counted

    want = loop_grad(model, own, x, t)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(x, t, return_dict=return_dict)
        (out.loss if return_dict else out[0]).backward()
    assert_grad1(model, want, f"NetworkB (return_dict={return_dict})")
    for n, p in model.named_parameters():
        assert_close(p.grad1.sum(0), p.grad, f"NetworkB: grad1 sum vs .grad, {n}")

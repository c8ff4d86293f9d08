"""A twelfth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` /
``jacrev`` / ``hessian``, per-example loops of autograd, and closed forms where the peer has
them). The first eleven sets are :mod:`test_peer_suites`, :mod:`test_peer_suites_more`,
:mod:`test_peer_suites_third` to :mod:`test_peer_suites_eleventh`; this one adds:

- pyDVL (``aai-institute/pyDVL``: ``tests/influence/torch/test_functional.py``,
  ``tests/influence/torch/test_influence_model.py``, ``tests/influence/conftest.py``): the
  per-sample gradients, matrix-Jacobian products and per-sample mixed derivatives
  ``∂ₓ∇_θ ℓ`` of a Linear under the MSE loss against its closed forms; the influences of
  up-weighting and of perturbing a training example (``InfluenceMode.Up`` /
  ``Perturbation``) on its networks (1-d to 3-d convolutions, a Linear stack, frozen first
  layers under the cross-entropy) with the Hessian, and by layer-wise blocks of its
  "Gauss-Newton" matrix (the mean of the per-example gradients' outer products: formed from
  ``grad1``, its diagonal from ``h.sum_grad_sq()``, its product with a matrix unformed);
- dattri (``TRAIS-Lab/dattri``: ``test/dattri/algorithm/test_tracin.py``,
  ``test_influence_function.py``, ``test_dvemb.py``): TracIn over two checkpoints of its
  ResNet-9 (BatchNorm statistics of their own, dropout) loaded in turn into the hooked model,
  normalized or not, its self-influence from ``h.norms()``; DataInf's layer-wise inverse of
  the damped empirical Fisher from ``grad1`` and ``h.param_norms()``; data value embeddings
  (DVEmb) from the per-example gradients taken inside a training loop, and from each
  Linear's kept inputs and output-gradients (its Kronecker factors, over tokens too);
- LogIX (``logix-project/logix``: ``tests/logger/test_mlp.py``, ``test_conv2d.py``,
  ``test_transformer.py``, ``tests/examples/test_add_lora.py``, ``logix/lora/modules.py``):
  per-sample gradients of its MLP (also under ``checkpoint_sequential``), its CNN and a BERT
  classifier over right-padded sequences (also with Hugging Face's gradient checkpointing),
  and its LoRA wrappers of Linear, Conv2d and Embedding layers (the low-rank branch added in
  place to the layer's output, its middle matrix shared by two layers too), whose middle
  matrix's ``grad1`` is the wrapped layer's projected, ``Cᵀ G Aᵀ``.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, vmap
from torch.utils.checkpoint import checkpoint_sequential

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import Logits, assert_close, flat_grads, grad1_of, hf, seeded, tiny_bert_config

D = torch.float64


flat = flat_grads


def trainable(model: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def state_from(model: nn.Module, theta: Tensor) -> dict[str, Tensor]:
    """The model's state for ``functional_call`` with its trainable parameters taken from
    ``theta`` (flattened in ``named_parameters()`` order, a tied one once), the frozen ones
    and the buffers as they are."""
    shapes = {n: p.shape for n, p in trainable(model).items()}
    parts = theta.split([s.numel() for s in shapes.values()])
    state = {n: p.detach() for n, p in model.named_parameters()} | dict(model.named_buffers())
    return state | {n: t.view(s) for (n, s), t in zip(shapes.items(), parts)}


def per_example_fn(model: nn.Module, loss_fn):
    """``(flat trainable parameters, x_i, y_i) -> example i's loss`` for ``torch.func``."""

    def loss(theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, state_from(model, theta), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    return loss


def theta_of(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in trainable(model).values()])


def sgd_step(model: nn.Module, loss: Tensor, lr: float) -> None:
    """``loss.backward()`` and plain SGD on ``.grad`` (``torch.optim.SGD``'s step, without
    the compiler its first use imports), ``.grad`` set to ``None`` after."""
    loss.backward()
    with torch.no_grad():
        for p in trainable(model).values():
            p -= lr * p.grad
            p.grad = None


# == pyDVL: tests/influence/torch/test_functional.py, test_influence_model.py ======================


def linear_closed_forms(layer: nn.Linear, x: Tensor, y: Tensor):
    """pyDVL's ``linear_derivative_analytical`` and ``linear_mixed_second_derivative_analytical``
    for ``ℓ(x, y) = mean_o (A x + b - y)_o²``: the per-example gradient ``[N, out·in + out]``
    (weight row-major, then bias) and the mixed derivative ``∂ₓ∇_θ ℓ`` ``[N, out·in + out, in]``."""
    a, n_out = layer.weight.detach(), layer.out_features
    r = x @ a.T + layer.bias.detach() - y  # [N, out]
    grads = 2 / n_out * torch.cat([(r[:, :, None] * x[:, None, :]).flatten(1), r], 1)
    # ∂/∂x_k of r_o x_i = a_ok x_i + r_o δ_ik; ∂/∂x_k of r_o = a_ok
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    w = a[None, :, None, :] * x[:, None, :, None] + r[:, :, None, None] * eye  # [N, o, i, k]
    mixed = torch.cat([w.flatten(1, 2), a.expand(len(x), -1, -1)], 1)
    return grads, 2 / n_out * mixed


def mixed_from_grad1(model: nn.Module, x: Tensor) -> Tensor:
    """``∂ₓ grad1`` ``[N, P, *x.shape[1:]]`` from a ``create_graph`` backward's ``grad1``:
    example ``i``'s gradient depends on ``x[i]`` alone, so the derivative of the sum over the
    batch of one entry of it is that entry's per-example derivative."""
    g = flat(grad1_of(model))
    cols = [torch.autograd.grad(g[:, j].sum(), x, retain_graph=True)[0] for j in range(g.shape[1])]
    return torch.stack(cols, 1)


@pytest.mark.parametrize(
    "shape", [(5, 3, 7), (4, 1, 6), (6, 4, 3)], ids=lambda s: "x".join(map(str, s))
)
def test_pydvl_linear_closed_forms(shape):
    """pyDVL's ``test_per_sample_gradient``, ``test_matrix_jacobian_product`` and
    ``test_mixed_derivatives``: a Linear under ``F.mse_loss`` (the mean over the batch and the
    outputs; input and target requiring grad, as there): ``grad1`` is the closed form
    ``2/out · (ŷ - y) xᵀ`` (and ``vmap(grad)``'s), a matrix ``G`` times the per-example
    gradients is ``G`` times the closed form's, and the derivative of ``grad1`` of a
    ``create_graph=True`` backward with respect to the input is the closed-form mixed
    derivative, and ``vmap(jacrev(grad))``'s."""
    n_in, n_out, n = shape
    layer = seeded(lambda: nn.Linear(n_in, n_out)).to(D)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, n_in, generator=g, dtype=D).requires_grad_()
    y = torch.randn(n, n_out, generator=g, dtype=D).requires_grad_()
    want_grads, want_mixed = linear_closed_forms(layer, x.detach(), y.detach())
    with gradhooks.add_hooks(layer):
        F.mse_loss(layer(x), y).backward(create_graph=True)
    got = flat(grad1_of(layer))
    assert_close(got.detach(), want_grads, f"{shape}: grad1 against the closed form")
    assert_close(
        got.detach(), flat(vmap_grad(layer, F.mse_loss, x.detach(), y.detach())), f"{shape}: vmap"
    )
    m = torch.randn(10, got.shape[1], generator=g, dtype=D)
    assert_close(m @ got.detach().T, m @ want_grads.T, f"{shape}: matrix-Jacobian product")
    mixed = mixed_from_grad1(layer, x)
    assert_close(mixed, want_mixed, f"{shape}: mixed derivative against the closed form")
    loss = per_example_fn(layer, F.mse_loss)
    oracle = vmap(jacrev(grad(loss), argnums=1), in_dims=(None, 0, 0))(
        theta_of(layer), x.detach(), y.detach()
    )
    assert_close(mixed, oracle, f"{shape}: mixed derivative against vmap(jacrev(grad))")
    gradhooks.clear_grad1(layer)


def conv3d_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(5, 3, 2), nn.Flatten(), nn.Linear(24, 3))


def conv2d_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(5, 3, 3), nn.Flatten(), nn.Linear(27, 3))


def conv1d_net(frozen: bool = False) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv1d(5, 3, 2).requires_grad_(not frozen), nn.Flatten(), nn.Linear(6, 2)
    )


def simple_regression() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3), nn.Linear(3, 1))


def simple_classifier() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10).requires_grad_(False), nn.Linear(10, 5))


# name: (model factory, input shape, outputs, loss, mode): pyDVL's InfluenceTestCases
PYDVL = {
    "conv3d_nn_up": (conv3d_net, (5, 3, 3, 3), 3, F.mse_loss, "up"),
    "conv3d_nn_pert": (conv3d_net, (5, 3, 3, 3), 3, F.smooth_l1_loss, "perturbation"),
    "conv2d_nn_up": (conv2d_net, (5, 5, 5), 3, F.mse_loss, "up"),
    "conv2d_nn_pert": (conv2d_net, (5, 5, 5), 3, F.smooth_l1_loss, "perturbation"),
    "conv1d_nn_up": (conv1d_net, (5, 3), 2, F.mse_loss, "up"),
    "conv1d_nn_pert": (conv1d_net, (5, 3), 2, F.smooth_l1_loss, "perturbation"),
    "simple_nn_up": (simple_regression, (10,), 1, F.mse_loss, "up"),
    "simple_nn_pert": (simple_regression, (10,), 1, F.smooth_l1_loss, "perturbation"),
    "conv1d_no_grad_up": (lambda: conv1d_net(frozen=True), (5, 3), 2, F.cross_entropy, "up"),
    "simple_nn_class_up": (simple_classifier, (10,), 5, F.cross_entropy, "up"),
}
REGULARIZATION = 5.0  # (H + λI positive definite on every network here)


def pydvl_problem(name: str, n_train: int = 8, n_test: int = 3):
    """pyDVL's ``model_and_data``: uniform inputs, uniform (or class) targets, the model trained
    by full-batch SGD (its ``minimal_training``, shortened) and put in eval."""
    factory, shape, outputs, loss, _ = PYDVL[name]
    model = seeded(factory).to(D)
    g = torch.Generator().manual_seed(2)
    x, x_test = (torch.rand(n, *shape, generator=g, dtype=D) for n in (n_train, n_test))
    if loss is F.cross_entropy:
        y, y_test = (torch.randint(outputs, (n,), generator=g) for n in (n_train, n_test))
    else:
        y, y_test = (torch.rand(n, outputs, generator=g, dtype=D) for n in (n_train, n_test))
    for _ in range(5):
        sgd_step(model, loss(model(x), y), lr=0.05)
    return model.eval(), loss, x, y, x_test, y_test


def train_hessian(model: nn.Module, loss_fn, x: Tensor, y: Tensor) -> Tensor:
    """The Hessian of the mean training loss over the trainable parameters, flattened, plus
    pyDVL's ``regularization · I`` (its ``DirectInfluence``)."""

    def mean_loss(theta: Tensor) -> Tensor:
        return loss_fn(functional_call(model, state_from(model, theta), (x,)), y)

    h = hessian(mean_loss)(theta_of(model))
    return h + REGULARIZATION * torch.eye(len(h), dtype=h.dtype)


def hooked_influences(model: nn.Module, loss_fn, x, y, x_test, y_test, h: Tensor, mode: str):
    """pyDVL's influences in gradhooks' terms: the factors ``H⁻¹ ∇ℓ_test`` from the test batch's
    ``grad1``; ``Up``: minus their dot products with the training batch's ``grad1``
    ``[test, train]``; ``Perturbation``: the derivative of those with respect to the training
    inputs, through a ``create_graph=True`` backward ``[test, train, *input]``."""
    with gradhooks.add_hooks(model) as hooks:
        loss_fn(model(x_test), y_test).backward()
        factors = torch.linalg.solve(h, flat(grad1_of(model)).T).T  # [test, P]
        hooks.clear()
        xt = x.clone().requires_grad_(mode == "perturbation")
        loss_fn(model(xt), y).backward(create_graph=mode == "perturbation")
        scores = -factors @ flat(grad1_of(model)).T  # [test, train]
        if mode == "up":
            out = scores.detach()
        else:
            rows = [torch.autograd.grad(s.sum(), xt, retain_graph=True)[0] for s in scores]
            out = torch.stack(rows)
        hooks.clear()
    model.zero_grad(set_to_none=True)
    return out


def oracle_influences(model: nn.Module, loss_fn, x, y, x_test, y_test, h: Tensor, mode: str):
    """The same by ``torch.func``: ``vmap(grad)`` of each example's loss, ``vmap(jacrev(grad))``
    with respect to its input for ``Perturbation``."""
    loss = per_example_fn(model, loss_fn)
    theta = theta_of(model)
    test_grads = vmap(grad(loss), in_dims=(None, 0, 0))(theta, x_test, y_test)
    factors = torch.linalg.solve(h, test_grads.T).T
    if mode == "up":
        return -factors @ vmap(grad(loss), in_dims=(None, 0, 0))(theta, x, y).T
    mixed = vmap(jacrev(grad(loss), argnums=1), in_dims=(None, 0, 0))(theta, x, y)  # [N, P, *in]
    return -torch.einsum("tp,np...->tn...", factors, mixed)


@pytest.mark.parametrize("name", list(PYDVL))
def test_pydvl_influences(name):
    """pyDVL's ``test_influences_*`` against its ``DirectInfluence``: on its networks (trained a
    little, in eval), the influence of up-weighting each training example on each test
    example's loss (``MSELoss``, the cross-entropy with a frozen first layer) or of perturbing
    its input (``SmoothL1Loss``), ``-∇ℓ_testᵀ (H + λI)⁻¹ ∇ℓ_train`` from ``grad1``, is
    ``torch.func``'s, and so are those of the training set on itself (``Up``)."""
    model, loss_fn, x, y, x_test, y_test = pydvl_problem(name)
    mode = PYDVL[name][4]
    h = train_hessian(model, loss_fn, x, y)
    got = hooked_influences(model, loss_fn, x, y, x_test, y_test, h, mode)
    want = oracle_influences(model, loss_fn, x, y, x_test, y_test, h, mode)
    shape = (len(x_test), len(x)) + ((*x.shape[1:],) if mode == "perturbation" else ())
    assert got.shape == shape, f"{name}: {tuple(got.shape)}"
    assert want.abs().max() > 1e-6, f"{name}: the influences vanish"
    assert_close(got, want, f"{name}: {mode} influences")
    if mode == "up":  # (pyDVL's direct_sym_influences)
        sym = hooked_influences(model, loss_fn, x, y, x, y, h, mode)
        want = oracle_influences(model, loss_fn, x, y, x, y, h, mode)
        assert_close(sym, want, f"{name}: the training set's influences on itself")


def blocks_of(model: nn.Module) -> dict[str, slice]:
    """pyDVL's ``BlockMode.LAYER_WISE``: each module's trainable parameters, as a slice of the
    flattened parameters (in ``named_parameters()`` order)."""
    out, start = {}, 0
    for name, p in trainable(model).items():
        layer = name.rpartition(".")[0]
        s = out.get(layer, slice(start, start))
        out[layer] = slice(s.start, start + p.numel())
        start += p.numel()
    return out


@pytest.mark.parametrize("name", [n for n, c in PYDVL.items() if c[4] == "up"])
def test_pydvl_gauss_newton_by_block(name):
    """pyDVL's ``SecondOrderMode.GAUSS_NEWTON`` and ``BlockMode.LAYER_WISE``
    (``test_composable_influence``): its "Gauss-Newton" matrix, the mean of the per-example
    gradients' outer products (``functional.gauss_newton``), summed from ``grad1`` over
    batches of 3 (the last short), with its diagonal from ``h.sum_grad_sq()`` and its product
    with a matrix taken without forming it (``GaussNewtonBatchOperation``), is
    ``vmap(grad)``'s; and the influences by block (each layer's block of that matrix,
    regularized, inverted alone) are ``torch.func``'s."""
    model, loss_fn, x, y, x_test, y_test = pydvl_problem(name)
    loss = per_example_fn(model, loss_fn)
    want_g = vmap(grad(loss), in_dims=(None, 0, 0))(theta_of(model), x, y)
    want_test = vmap(grad(loss), in_dims=(None, 0, 0))(theta_of(model), x_test, y_test)
    n, dim = want_g.shape
    v = torch.randn(dim, 2, generator=torch.Generator().manual_seed(8), dtype=D)
    gn, diag, mvp, rows = 0, 0, 0, []
    with gradhooks.add_hooks(model, quantities=("grad1", "sum_grad_sq")) as h:
        for r in batches(n, 3):
            model.zero_grad()
            loss_fn(model(x[r]), y[r]).backward()
            g = flat(grad1_of(model))
            gn, mvp = gn + g.T @ g / n, mvp + g.T @ (g @ v) / n
            diag = diag + flat([h.sum_grad_sq()[k][None] for k in trainable(model)])[0] / n
            rows.append(g)
        model.zero_grad()
        loss_fn(model(x_test), y_test).backward()
        test = flat(grad1_of(model))
    model.zero_grad(set_to_none=True)
    train = torch.cat(rows)
    assert_close(train, want_g, f"{name}: grad1")
    assert_close(gn, want_g.T @ want_g / n, f"{name}: Gauss-Newton matrix")
    assert_close(diag, gn.diagonal(), f"{name}: its diagonal from sum_grad_sq")
    assert_close(mvp, gn @ v, f"{name}: its product, unformed")
    for layer, s in blocks_of(model).items():
        eye = REGULARIZATION * torch.eye(s.stop - s.start, dtype=D)
        got = -test[:, s] @ torch.linalg.solve(gn[s, s] + eye, train[:, s].T)
        want = -want_test[:, s] @ torch.linalg.solve(
            want_g[:, s].T @ want_g[:, s] / n + eye, want_g[:, s].T
        )
        assert want.abs().max() > 1e-8, f"{name}: {layer}'s influences vanish"
        assert_close(got, want, f"{name}: {layer}'s influences")


# == dattri: test/dattri/algorithm/test_tracin.py, test_influence_function.py, test_dvemb.py =======


class BasicBlock(nn.Module):
    """dattri's ResNet-9 block (``dattri/benchmark/models/resnet9``): two bias-free convolutions,
    each followed by a BatchNorm, a ReLU and a dropout, and a shortcut convolution + BatchNorm
    where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1, self.drop1 = nn.BatchNorm2d(c_out), nn.Dropout(0.1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2, self.drop2 = nn.BatchNorm2d(c_out), nn.Dropout(0.1)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                nn.BatchNorm2d(c_out),
                nn.Dropout(0.1),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.drop1(F.relu(self.bn1(self.conv1(x))))
        out = self.drop2(F.relu(self.bn2(self.conv2(out))))
        return F.relu(out + self.shortcut(x))


class ResNet9(nn.Module):
    """dattri's ``ResNet9`` for CIFAR-2, narrowed (widths 4 to 8) for ``[3, 4, 4]`` images."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4)
        self.dropout1 = nn.Dropout(0.1)
        self.layer1 = nn.Sequential(BasicBlock(4, 6))
        self.layer2 = nn.Sequential(BasicBlock(6, 8, stride=2))
        self.linear = nn.Linear(8, classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.dropout1(F.relu(self.bn1(self.conv1(x))))
        out = self.layer2(self.layer1(out))
        return self.linear(F.adaptive_avg_pool2d(out, (1, 1)).view(len(x), -1))


def images(seed: int, n: int, n_test: int, shape: tuple, classes: int):
    """Training and test images ``[n, *shape]`` from ``randn`` and their class labels, as
    dattri's tests draw them."""
    g = torch.Generator().manual_seed(seed)
    x, x_test = (torch.randn(k, *shape, generator=g, dtype=D) for k in (n, n_test))
    y, y_test = (torch.randint(classes, (k,), generator=g) for k in (n, n_test))
    return x, y, x_test, y_test


def batches(n: int, size: int):
    """The index ranges of an unshuffled loader of ``n`` examples, the last batch short."""
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def resnet_checkpoints(x: Tensor, y: Tensor) -> list[dict]:
    """Two checkpoints of dattri's ``train_cifar_resnet9`` (after one and two epochs, batches of
    4, in training: the BatchNorms' running statistics move with the weights)."""
    model = seeded(ResNet9).to(D).train()
    saved = []
    for _ in range(2):
        for rows in batches(len(x), 4):
            sgd_step(model, F.cross_entropy(model(x[rows]), y[rows]), lr=0.1)
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
    return saved


def normalize(g: Tensor) -> Tensor:
    return g / g.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized_grad", "raw_grad"])
def test_dattri_tracin_over_checkpoints(normalized):
    """dattri's ``test_tracin`` and ``test_cifar2_multi_ckpts_grad``: TracIn's scores over two
    checkpoints of its ResNet-9 (BatchNorm and dropout, in eval) loaded in turn into the hooked
    model, ``Σ_c w_c ĝ_trainᵀ ĝ_test`` (gradients normalized or not), from ``grad1`` of
    batches of 4 (train) and 2 (test) under the mean cross-entropy, are the loop's at each
    checkpoint; the self-influence ``Σ_c w_c |g|²`` is read from ``h.norms()``. A checkpoint's
    BatchNorm statistics count: with the other checkpoint's, the loop's gradients differ (what
    dattri's test shows of parameters saved without their buffers)."""
    x, y, x_test, y_test = images(3, 6, 3, (3, 4, 4), classes=2)
    checkpoints, weights = resnet_checkpoints(x, y), (0.7, 1.3)
    model = seeded(ResNet9).to(D).eval()
    reference = seeded(ResNet9).to(D).eval()
    got, want = torch.zeros(6, 3, dtype=D), torch.zeros(6, 3, dtype=D)
    got_self, want_self = torch.zeros(6, dtype=D), torch.zeros(6, dtype=D)
    prep = normalize if normalized else (lambda t: t)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for state, w in zip(checkpoints, weights):
            model.load_state_dict(state)
            reference.load_state_dict(state)
            rows = []
            for part, (xs, ys, size) in enumerate(((x, y, 4), (x_test, y_test, 2))):
                grads = []
                for r in batches(len(xs), size):
                    model.zero_grad()
                    F.cross_entropy(model(xs[r]), ys[r]).backward()
                    grads.append(flat(grad1_of(model)))
                    if part == 0:
                        got_self[r] += w * h.norms().square()
                rows.append(torch.cat(grads))
            got += w * prep(rows[0]) @ prep(rows[1]).T
            want_train = flat(vmap_grad(reference, F.cross_entropy, x, y))
            want_test = flat(vmap_grad(reference, F.cross_entropy, x_test, y_test))
            want += w * prep(want_train) @ prep(want_test).T
            want_self += w * want_train.square().sum(1)
    assert_close(got, want, "TracIn scores")
    assert_close(got_self, want_self, "TracIn self-influence from the norms")
    stale = {**checkpoints[0], **{k: v for k, v in checkpoints[1].items() if "running" in k}}
    reference.load_state_dict(checkpoints[0])
    first = flat(vmap_grad(reference, F.cross_entropy, x, y))
    reference.load_state_dict(stale)
    moved = flat(vmap_grad(reference, F.cross_entropy, x, y))
    assert (first - moved).abs().max() > 1e-6, "the checkpoints' BatchNorm statistics do not differ"


def mnist_lr() -> nn.Sequential:
    """dattri's ``LogisticRegressionMnist`` for ``[1, 6, 6]`` images."""
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 10))


class MnistMLP(nn.Module):
    """dattri's ``MLPMnist`` (``fc1``-``fc3`` with dropout), narrowed for ``[1, 6, 6]`` images."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(36, 12), nn.Linear(12, 8), nn.Linear(8, 10)
        self.dropout1, self.dropout2 = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.dropout1(torch.relu(self.fc1(x.view(-1, 36))))
        return self.fc3(self.dropout2(torch.relu(self.fc2(x))))


def layers_of(model: nn.Module) -> dict[str, list[str]]:
    """dattri's ``param_layer_map``: the trainable parameters grouped by the module holding them."""
    out: dict[str, list[str]] = {}
    for name in trainable(model):
        out.setdefault(name.rpartition(".")[0], []).append(name)
    return out


def datainf(train: dict, train_sq: dict, test: dict, layers: dict, r: float) -> Tensor:
    """dattri's ``IFAttributorDataInf``: per layer ``l``, each test gradient ``v`` becomes
    ``q = meanᵢ (v - (v·gᵢ) / (r + |gᵢ|²) gᵢ) / r`` over the training gradients ``gᵢ``; the score
    of training example ``k`` for test example ``t`` is ``Σ_l g_kᵀ q_t`` ``[train, test]``.
    ``train_sq[l]`` holds ``|gᵢ|²`` of layer ``l`` ``[train]``."""
    total = 0
    for layer, names in layers.items():
        g, v = flat([train[n] for n in names]), flat([test[n] for n in names])
        coef = (v @ g.T) / (r + train_sq[layer])  # [test, train]
        q = (v - coef @ g / len(g)) / r
        total = total + g @ q.T
    return total


@pytest.mark.parametrize("factory", [mnist_lr, MnistMLP], ids=["mnist_lr", "mnist_mlp"])
def test_dattri_datainf(factory):
    """dattri's ``test_influence_function`` (``IFAttributorDataInf``) and
    ``test_influence_function_ensemble``: DataInf's layer-wise closed-form inverse of the
    damped empirical Fisher, its layers' squared gradient norms taken from gradhooks'
    per-parameter norms (``h.param_norms()``, summed over a layer's weight and bias) and its
    gradients from ``grad1`` (batches of 4, the last short, then the test batch), equals the
    same from ``vmap(grad)``, on its MNIST logistic regression and MLP (dropout, in eval); and
    two checkpoints holding the same state, loaded in turn into the hooked model, average to
    the same scores."""
    model = seeded(factory).to(D).eval()
    x, y, x_test, y_test = images(4, 10, 3, (1, 6, 6), classes=10)
    layers = layers_of(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want_train = vmap_grad(model, F.cross_entropy, x, y)
    want_test = vmap_grad(model, F.cross_entropy, x_test, y_test)
    want_sq = {k: flat([want_train[n] for n in ns]).square().sum(1) for k, ns in layers.items()}
    want = datainf(want_train, want_sq, want_test, layers, r=0.01)
    assert want.abs().max() > 1e-3
    scores = []
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for checkpoint in range(2):
            model.load_state_dict(state)
            parts, sq = [], []
            for r in batches(10, 4):
                model.zero_grad()
                F.cross_entropy(model(x[r]), y[r]).backward()
                parts.append(grad1_of(model))
                norms = h.param_norms()
                sq.append({k: sum(norms[n].square() for n in ns) for k, ns in layers.items()})
            model.zero_grad()
            F.cross_entropy(model(x_test), y_test).backward()
            train = {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
            train_sq = {k: torch.cat([s[k] for s in sq]) for k in layers}
            for k in layers:
                assert_close(train_sq[k], want_sq[k], f"checkpoint {checkpoint}: {k} squared norms")
            scores.append(datainf(train, train_sq, grad1_of(model), layers, r=0.01))
            assert_close(scores[-1], want, f"checkpoint {checkpoint}: DataInf scores")
    assert_close(sum(scores) / 2, want, "DataInf scores averaged over the checkpoints")


class TokenLinear(nn.Module):
    """A Linear over ``[batch, tokens, features]`` then mean pooling and a head: the sequence
    inputs dattri's DVEmb reconstructs by ``einsum("bli,blo->boi", A, B)``."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(6, 5), nn.Linear(5, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(x.view(len(x), 6, 6))).mean(1))


def dvemb(steps: list, n: int) -> dict[int, Tensor]:
    """dattri's ``DVEmbAttributor.cache``: walking back over the steps ``(epoch, η_t, indices,
    per-example gradients)``, ``e_t = η_t g_t - η_t g_t Mᵀ`` added to the examples' rows of
    their epoch's embedding and ``M += e_tᵀ g_t``."""
    m = torch.zeros(steps[0][3].shape[1], steps[0][3].shape[1], dtype=D)
    out: dict[int, Tensor] = {}
    for epoch, eta, rows, g in reversed(steps):
        e = eta * g - eta * (g @ m.T)
        out.setdefault(epoch, torch.zeros(n, g.shape[1], dtype=D)).index_add_(0, rows, e)
        m += e.T @ g
    return out


@pytest.mark.parametrize("factory", [mnist_lr, TokenLinear], ids=["mnist_lr", "token_linear"])
def test_dattri_dvemb(factory):
    """dattri's ``test_dvemb_context_matches_direct`` and ``_run_dvemb_simulation``: data value
    embeddings over two epochs of SGD (batches of 4, the last short, the mean cross-entropy,
    ``η_t = lr / batch``), the per-example gradients taken by gradhooks inside the training
    loop (its ``cache_gradients_context``) or by ``vmap(grad)`` before each step (its
    ``cache_gradients``): the same embeddings per epoch (the later steps' correction of
    each not zero) and the same scores; and its Kronecker factors, each Linear's kept input
    ``A`` and output gradient ``B`` (times the batch, for the mean), give its ``grad1``."""
    model = seeded(factory).to(D)
    reference = seeded(factory).to(D)
    x, y, x_test, y_test = images(5, 10, 3, (1, 6, 6), classes=10)
    lr, got_steps, want_steps = 0.5, [], []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with gradhooks.add_hooks(model, keep_backprops=True) as h:
        for epoch in range(2):
            for r in batches(10, 4):
                rows = torch.tensor(list(r))
                want = flat(vmap_grad(reference, F.cross_entropy, x[r], y[r]))
                want_steps.append((epoch, lr / len(r), rows, want))
                sgd_step(reference, F.cross_entropy(reference(x[r]), y[r]), lr)
                h.clear()  # (the factors are kept until then: one per step, as dattri's)
                sgd_step(model, F.cross_entropy(model(x[r]), y[r]), lr)
                got_steps.append((epoch, lr / len(r), rows, flat(grad1_of(model))))
                for lin in linears:
                    a, (b,) = h.activations(lin), h.backprops(lin)
                    w = torch.einsum("b...i,b...o->boi", a, b * len(r))
                    assert_close(w, lin.weight.grad1, f"epoch {epoch} {list(r)}: A, B")
        h.clear()
        model.zero_grad()
        F.cross_entropy(model(x_test), y_test).backward()
        test = flat(grad1_of(model))
    want_test = flat(vmap_grad(reference, F.cross_entropy, x_test, y_test))
    assert_close(test, want_test, "test gradients at the last step")
    got, want = dvemb(got_steps, 10), dvemb(want_steps, 10)
    for epoch in (0, 1):
        assert_close(got[epoch], want[epoch], f"epoch {epoch}'s embeddings")
    total = (got[0] + got[1]) @ test.T
    assert_close(total, (want[0] + want[1]) @ want_test.T, "scores")
    first_epoch = torch.cat([eta * g for epoch, eta, _, g in got_steps if epoch == 0])
    assert (got[0] - first_epoch).abs().max() > 1e-6, "the later steps change no embedding"


# == LogIX: tests/logger/test_mlp.py, test_conv2d.py, test_transformer.py, logix/lora/ ============


def logix_mlp() -> nn.Sequential:
    """LogIX's ``create_mlp(4, 8, 5)``: GELU, ReLU and Tanh between four Linears."""
    return nn.Sequential(
        nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5),
    )  # fmt: skip


class Simple2DCNN(nn.Module):
    """LogIX's ``Simple2DCNN(1, 8, 10)`` for ``[1, 8, 8]`` images: bias-free padded
    convolutions, a max-pool, a Linear."""

    def __init__(self, channels: int = 1, hidden: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, hidden, 3, 1, 1, bias=False)
        self.relu, self.pool = nn.ReLU(), nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, 1, 1, bias=False)
        self.fc = nn.Linear(hidden * 4 * 4, classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.conv2(self.pool(self.relu(self.conv1(x)))))
        return self.fc(out.view(out.size(0), -1))


class Checkpointed(nn.Module):
    """LogIX's ``checkpoint_sequential(model, segments=2, input, use_reentrant=False)``."""

    def __init__(self, seq: nn.Sequential):
        super().__init__()
        self.seq = seq

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint_sequential(self.seq, 2, x, use_reentrant=False)


def logix_bert(checkpointing: bool) -> nn.Module:
    """LogIX's ``BertForSequenceClassification`` (narrowed, 10 labels), its logits; with
    Hugging Face's non-reentrant gradient checkpointing, in training (where it applies: no
    dropout here), or in eval."""
    bert = hf("BertForSequenceClassification")(tiny_bert_config(num_labels=10))
    if checkpointing:
        bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return Logits(bert, last=False).to(D).train(checkpointing)


MASK = torch.tensor([[1] * 8 + [0] * 2, [1] * 7 + [0] * 3, [1] * 5 + [0] * 5, [1] * 10])

# name: (model factory, inputs (the batch of 4))
LOGIX = {
    "mlp": (lambda: logix_mlp().eval(), lambda g: torch.randn(4, 4, generator=g, dtype=D)),
    "mlp_checkpoint_sequential": (
        lambda: Checkpointed(logix_mlp()).eval(),
        lambda g: torch.randn(4, 4, generator=g, dtype=D),
    ),
    "conv2d": (
        lambda: Simple2DCNN().eval(),
        lambda g: torch.randn(4, 1, 8, 8, generator=g, dtype=D),
    ),
    "bert_mask": (
        lambda: logix_bert(False),
        lambda g: (torch.randint(20, (4, 10), generator=g), MASK),
    ),
    "bert_mask_gradient_checkpointing": (
        lambda: logix_bert(True),
        lambda g: (torch.randint(20, (4, 10), generator=g), MASK),
    ),
}


@pytest.mark.parametrize("name", list(LOGIX))
def test_logix_per_sample_gradients(name):
    """LogIX's ``test_per_sample_gradient`` (``_with_gradient_checkpoint``, ``_mask``): its MLP,
    its CNN and a BERT classifier over right-padded sequences with their attention mask (with
    gradient checkpointing too), under the summed cross-entropy: every parameter's ``grad1``
    (LogIX logs the weights') is the per-example loop's, and ``vmap(grad)``'s where the model
    runs under it."""
    factory, inputs = LOGIX[name]
    model = seeded(factory).to(D)
    g = torch.Generator().manual_seed(6)
    x = inputs(g)
    y = torch.tensor([1, 3, 0, 2])
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.zero_grad()
        out = model(*x) if isinstance(x, tuple) else model(x)
        F.cross_entropy(out, y, reduction="sum").backward()
    assert out.shape == (4, 10 if "bert" in name or name == "conv2d" else 5)
    want = loop_grad(model, F.cross_entropy, x, y)
    if "bert" not in name and "checkpoint" not in name:  # (torch.func refuses checkpointing)
        assert_close(flat(vmap_grad(model, F.cross_entropy, x, y)), flat(want), f"{name}: vmap")
    assert want.keys() == grad1_of(model).keys()
    for n, w in want.items():
        assert_close(grad1_of(model)[n], w, f"{name}: {n}")
    gradhooks.clear_grad1(model)


class LoraLinear(nn.Module):
    """LogIX's ``LoraLinear``: the Linear's output plus ``C(B(A(x)))``, added in place, ``B``
    (rank x rank, zero at first) the layer whose gradient LogIX logs, maybe shared."""

    def __init__(self, rank: int, linear: nn.Linear, shared: nn.Module | None = None):
        super().__init__()
        self.rank = min(rank, linear.in_features, linear.out_features)
        self.logix_lora_A = nn.Linear(linear.in_features, self.rank, bias=False)
        self.logix_lora_B = shared or nn.Linear(self.rank, self.rank, bias=False)
        self.logix_lora_C = nn.Linear(self.rank, linear.out_features, bias=False)
        nn.init.zeros_(self.logix_lora_B.weight)
        self._linear = linear

    def forward(self, x: Tensor) -> Tensor:
        result = self._linear(x)
        result += self.logix_lora_C(self.logix_lora_B(self.logix_lora_A(x)))
        return result


class LoraConv2d(nn.Module):
    """LogIX's ``LoraConv2d``: ``A`` a convolution of the layer's kernel, stride and padding to
    ``rank`` channels, ``B`` and ``C`` 1x1 convolutions."""

    def __init__(self, rank: int, conv: nn.Conv2d, shared: nn.Module | None = None):
        super().__init__()
        self.rank = min(rank, conv.in_channels, conv.out_channels)
        self.logix_lora_A = nn.Conv2d(
            conv.in_channels, self.rank, conv.kernel_size, conv.stride, conv.padding, bias=False
        )
        self.logix_lora_B = shared or nn.Conv2d(self.rank, self.rank, 1, bias=False)
        self.logix_lora_C = nn.Conv2d(self.rank, conv.out_channels, 1, bias=False)
        nn.init.zeros_(self.logix_lora_B.weight)
        self._conv = conv

    def forward(self, x: Tensor) -> Tensor:
        result = self._conv(x)
        result += self.logix_lora_C(self.logix_lora_B(self.logix_lora_A(x)))
        return result


class LoraEmbedding(nn.Module):
    """LogIX's ``LoraEmbedding``: ``A`` an embedding to ``rank`` features, ``B`` and ``C``
    Linears."""

    def __init__(self, rank: int, embedding: nn.Embedding):
        super().__init__()
        self.rank = min(rank, embedding.num_embeddings, embedding.embedding_dim)
        self.logix_lora_A = nn.Embedding(embedding.num_embeddings, self.rank)
        self.logix_lora_B = nn.Linear(self.rank, self.rank, bias=False)
        self.logix_lora_C = nn.Linear(self.rank, embedding.embedding_dim, bias=False)
        nn.init.zeros_(self.logix_lora_B.weight)
        self._embedding = embedding

    def forward(self, x: Tensor) -> Tensor:
        result = self._embedding(x)
        result += self.logix_lora_C(self.logix_lora_B(self.logix_lora_A(x)))
        return result


def lora_mlp(shared: bool = False) -> nn.Sequential:
    b = nn.Linear(3, 3, bias=False) if shared else None
    return nn.Sequential(
        LoraLinear(3, nn.Linear(6, 8), b), nn.ReLU(), LoraLinear(3, nn.Linear(8, 5), b)
    )


def lora_cnn() -> nn.Sequential:
    return nn.Sequential(
        LoraConv2d(2, nn.Conv2d(2, 4, 3, stride=2, padding=1)), nn.ReLU(), nn.Flatten(),
        LoraLinear(3, nn.Linear(4 * 3 * 3, 5)),
    )  # fmt: skip


class LoraBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = LoraEmbedding(3, nn.Embedding(12, 6)), nn.Linear(6, 5)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def projected(wrapper: nn.Module, grad1: dict[str, Tensor], name: str) -> Tensor:
    """What LogIX's ``B`` holds: the wrapped layer's per-example gradient ``[N, out, in]``
    projected by ``C`` on the left and ``A`` on the right, ``Cᵀ G Aᵀ`` (a convolution's kernel
    flattened into ``in``; an embedding's table ``[N, rows, dim]`` read as ``Gᵀ``)."""
    base = next(n for n, _ in wrapper.named_children() if n.startswith("_"))
    w = grad1[f"{name}.{base}.weight"]
    a, c = wrapper.logix_lora_A.weight.detach(), wrapper.logix_lora_C.weight.detach()
    if isinstance(getattr(wrapper, base), nn.Embedding):  # (a: [rows, rank], c: [dim, rank])
        return torch.einsum("dr,nvd,vs->nrs", c, w, a)
    p = torch.einsum("or,noi,si->nrs", c.flatten(1), w.flatten(2), a.flatten(1))
    return p.reshape(len(w), *wrapper.logix_lora_B.weight.shape)


# name: (model factory, inputs)
LORA = {
    "linear": (lora_mlp, lambda g: torch.randn(5, 6, generator=g, dtype=D)),
    "linear_shared_B": (
        lambda: lora_mlp(shared=True),
        lambda g: torch.randn(5, 6, generator=g, dtype=D),
    ),
    "conv2d": (lora_cnn, lambda g: torch.randn(5, 2, 6, 6, generator=g, dtype=D)),
    "embedding": (LoraBag, lambda g: torch.randint(12, (5, 4), generator=g)),
}


@pytest.mark.parametrize("name", list(LORA))
def test_logix_lora_projected_gradients(name):
    """LogIX's ``LoraLinear`` / ``LoraConv2d`` / ``LoraEmbedding`` (``tests/examples/
    test_add_lora.py``; ``B`` zero, its output added in place to the wrapped layer's, ``B``
    shared by two layers too): every parameter's ``grad1`` (the wrapped layer's, ``A``, ``B``,
    ``C``) is the per-example loop's, and ``B``'s is the wrapped layer's projected, ``Cᵀ G
    Aᵀ`` (summed over the layers sharing it): the low-rank gradient LogIX logs in place of the
    whole one."""
    factory, inputs = LORA[name]
    model = seeded(factory).to(D)
    x = inputs(torch.Generator().manual_seed(7))
    y = torch.tensor([0, 4, 1, 3, 2])
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    got = grad1_of(model)
    want = loop_grad(model, F.cross_entropy, x, y)
    assert want.keys() == got.keys()
    for n, w in want.items():
        assert_close(got[n], w, f"{name}: {n}")
    wrappers = {n: m for n, m in model.named_modules() if hasattr(m, "logix_lora_B")}
    by_b: dict[int, Tensor] = {}
    for n, m in wrappers.items():
        b = id(m.logix_lora_B.weight)
        by_b[b] = by_b.get(b, 0) + projected(m, got, n)
    for n, m in wrappers.items():
        b_name = next(k for k, p in model.named_parameters() if p is m.logix_lora_B.weight)
        assert by_b[id(m.logix_lora_B.weight)].abs().max() > 1e-6, f"{name}: {n} projects to zero"
        assert_close(got[b_name], by_b[id(m.logix_lora_B.weight)], f"{name}: {n} B as projected")
    gradhooks.clear_grad1(model)

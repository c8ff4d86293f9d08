"""A third set of the cases that other per-example-gradient and curvature projects check in
their own test suites, written in gradhooks' terms and compared with float64 references
(``torch.func`` ``vmap(grad)`` / ``vmap(jacrev)`` and per-example loops). The first two sets
are :mod:`test_peer_suites` and :mod:`test_peer_suites_more`; this one adds:

- nngeometry (``tests/test_jacobian.py``, ``tests/tasks.py``, ``tests/test_m2gradients.py``):
  per-example Jacobians of its task networks (linear and non-linear; BatchNorm in eval,
  GroupNorm, its ``Cosine1d``, ``WeightNorm1d/2d`` and ``Affine1d`` layers, a skip
  connection), the dense Fisher (``FIM``), the Gram matrix (``FMatDense``) and the second
  moment of the gradients built from them;
- ASDL (``tests/test_unit_wise.py``, ``tests/test_fisher*.py``): batch gradients, the
  empirical Fisher (full, diagonal, unit-wise) and its accumulation over a data loader;
- BackPACK (``test/extensions/firstorder``): ``BatchL2Grad``, ``SumGradSquared`` and
  ``Variance`` on transposed convolutions, BatchNorm in eval, Embedding and its custom modules
  (``ScaleModule``, ``Permute``, ``Pad``, ``Slicing``, ``Branch`` / ``Merge``), and
  ``BatchGrad`` with ``subsampling``;
- dp-transformers (``tests/test_grad_sample/*``, ``data_collators.py``): BART's learned
  positional embedding, T5's layer norm, a merged LoRA layer over part of ``q, k, v``, GPT-2
  with the ``position_ids`` of its private collator, and one ``DPTrainer`` step with them;
- Opacus (``tests/grad_samples/``, ``tests/dp_layers/``, ``privacy_engine_test.py``,
  ``accountants_test.py``): its ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` and
  ``DPMultiheadAttention`` (layers built from Linear cells), instance norm, RMSNorm, DP steps
  against vanilla training, ``make_private_with_epsilon``, and the accountants against the
  exact Gaussian mechanism;
- curvlinops (``test/test_ggn.py``, ``test_ef.py``, losses over flattened positions) and
  functorch's per-sample gradients with ``randomness="different"`` (dropout drawn per
  example) and ``vjp``;
- every set: the DP step (grad1, ghost clipping, book-keeping) through their layers, and the
  Jacobians, K-FAC factors and ``out.backward(v)`` of networks whose output is a recurrent
  or attention layer's own (the backward rooted at one of a call's several outputs).

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one),
so ``grad1.sum(0)`` (sum loss) or ``grad1.mean(0)`` (mean loss) is ``.grad``. Every comparison
is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says otherwise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import as_double, assert_close, seeded
from harness import sum_of_squares as sq

D = torch.float64


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def hooked(model, inputs, loss=sq, target=None, reduction="sum", quantities=("grad1",)):
    """One forward and backward of ``loss`` under ``add_hooks``; the (removed) handle."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=quantities) as h:
        out = model(*inputs)
        (loss(out) if target is None else loss(out, target)).backward()
    return h


def oracle_check(model, inputs, loss=sq, target=None, reduction="sum", loop=False):
    """``model`` (made float64) under gradhooks: every trainable parameter's ``grad1`` equals
    ``vmap(grad)`` (and the per-example loop with ``loop=True``) and reduces to ``.grad``.
    Returns the oracle's per-example gradients."""
    model = model.double()
    inputs = tuple(as_double(t) for t in (inputs if isinstance(inputs, tuple) else (inputs,)))
    want = vmap_grad(model, loss, inputs, target)
    if loop:
        by_loop = loop_grad(model, loss, inputs, target)
        for n in want:
            assert_close(by_loop[n], want[n], f"loop vs vmap, {n}")
    hooked(model, inputs, loss, target, reduction)
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"frozen {n} got a grad1"
            continue
        assert_close(p.grad1, want[n], f"{type(model).__name__} ({reduction}): {n}")
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        assert_close(reduced, p.grad, f"grad1 reduced vs .grad, {n}")
        checked += 1
    assert checked, "no trainable parameter was checked"
    return want


def jacobians_by_jacrev(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """``{name: [batch, outputs, *p.shape]}``: each example's Jacobian of its flattened output
    with respect to every trainable parameter, by ``vmap(jacrev)`` of a batch of one."""
    params = {n: p.detach() for n, p in trainable(model).items()}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update(dict(model.named_buffers()))

    def one(p, xi):
        return functional_call(model, (p, rest), (xi.unsqueeze(0),)).reshape(-1)

    with gradhooks.paused():
        return vmap(jacrev(one), in_dims=(None, 0))(params, x)


def flat(jac: dict[str, Tensor], model: nn.Module) -> Tensor:
    """``[batch, outputs, P]``, the parameters in ``named_parameters()`` order."""
    return torch.cat([jac[n].flatten(2) for n in trainable(model)], 2)


# == nngeometry: tests/test_jacobian.py over the networks of tests/tasks.py ======================
# Its tasks run in eval mode on float64 (on the CPU); the layers are Linear, Conv2d, BatchNorm
# (eval), GroupNorm and its own Cosine1d, WeightNorm1d/2d and Affine1d (below: its definitions,
# rewritten). Smaller images here (the networks' shapes kept where they matter).


class Cosine1d(nn.Linear):
    """The cosine between each row of the weight and the input (nngeometry's layer)."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__(fan_in, fan_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(
            x / x.norm(dim=1, keepdim=True), self.weight / self.weight.norm(dim=1, keepdim=True)
        )


class WeightNorm1d(nn.Linear):
    """A Linear whose weight rows are normalized to norm 1 (nngeometry's layer)."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__(fan_in, fan_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight / self.weight.norm(dim=1, keepdim=True))


class WeightNorm2d(nn.Conv2d):
    """A Conv2d whose kernels are normalized to norm 1 per output channel (nngeometry's)."""

    def __init__(self, *args):
        super().__init__(*args, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        norms = self.weight.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        return self._conv_forward(x, self.weight / norms, None)


class Affine1d(nn.Module):
    """``x * weight + bias``, elementwise (nngeometry's layer)."""

    def __init__(self, features: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(features))
        self.bias = nn.Parameter(0.1 * torch.randn(features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.weight.unsqueeze(0)
        return out if self.bias is None else out + self.bias


class FCNet(nn.Module):
    """nngeometry's ``FCNet``: a crop of the image, then three layers of the chosen kind."""

    def __init__(self, normalization: str = "none", out: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        sizes = [8 * 8, 10, 10, out]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            if normalization == "weight_norm":
                layers.append(WeightNorm1d(a, b))
            elif normalization == "cosine":
                layers.append(Cosine1d(a, b))
            else:
                layers.append(nn.Linear(a, b, bias=normalization == "none"))
            if normalization == "batch_norm":
                layers.append(nn.BatchNorm1d(b))
            elif normalization == "affine":
                layers.append(Affine1d(b, bias=i % 2 == 0))
            layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, 3:-3, 3:-3].contiguous()
        return self.net(x.view(x.size(0), -1))


class ConvNet(nn.Module):
    """nngeometry's ``ConvNet`` on 28x28 images: conv (or WeightNorm2d) - norm - pool - conv -
    pool - conv - Linear (or WeightNorm1d) - norm - Linear."""

    def __init__(self, normalization: str = "none"):
        super().__init__()
        self.normalization = normalization
        wn = normalization == "weight_norm"
        self.conv1 = (
            WeightNorm2d(1, 6, 3, 2) if wn else nn.Conv2d(1, 6, 3, 2, bias=normalization == "none")
        )
        self.norm1 = {"batch_norm": nn.BatchNorm2d(6), "group_norm": nn.GroupNorm(2, 6)}.get(
            normalization, nn.Identity()
        )
        self.conv2 = nn.Conv2d(6, 5, 4, 1)
        self.conv3 = nn.Conv2d(5, 7, 3, 1, 1)
        self.fc1 = WeightNorm1d(7, 4) if wn else nn.Linear(7, 4)
        self.norm2 = nn.BatchNorm1d(4) if normalization == "batch_norm" else nn.Identity()
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = F.relu(self.conv3(x)).view(-1, 7)
        return self.fc2(F.relu(self.norm2(self.fc1(x))))


class SmallConvNet(nn.Module):
    """nngeometry's ``SmallConvNet``: two WeightNorm2d layers, the output summed over space."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = WeightNorm2d(1, 6, 3, 2), WeightNorm2d(6, 3, 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.l2(F.relu(self.l1(x)))).sum(dim=(2, 3))


class LinearFCNet(nn.Module):
    """nngeometry's ``LinearFCNet``: two Linear heads on the same image, each summed."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(14 * 14, 3), nn.Linear(14 * 14, 7, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x.view(x.size(0), -1)
        return torch.stack([self.fc1(x).sum(1), self.fc2(x).sum(1)], dim=1)


class LinearConvNet(nn.Module):
    """nngeometry's ``LinearConvNet``: two Conv2d heads on the same image, each summed."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 5, 3, 1), nn.Conv2d(1, 3, 2, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([self.conv1(x).sum((1, 2, 3)), self.conv2(x).sum((1, 2, 3))], dim=1)


class BatchNormFCLinearNet(nn.Module):
    """nngeometry's ``BatchNormFCLinearNet`` (eval): BatchNorm1d of ``x`` and of ``-x``."""

    def __init__(self):
        super().__init__()
        self.fc0, self.bn1, self.bn2 = (
            nn.Linear(14 * 14, 20),
            nn.BatchNorm1d(20),
            nn.BatchNorm1d(20),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc0(x.view(x.size(0), -1))
        return torch.stack([self.bn1(x).sum(1), self.bn2(-x).sum(1)], dim=1)


class BatchNormConvLinearNet(nn.Module):
    """nngeometry's ``BatchNormConvLinearNet`` (eval): BatchNorm2d of ``h`` and of ``-h``."""

    def __init__(self):
        super().__init__()
        self.conv0, self.bn1, self.bn2 = nn.Conv2d(1, 5, 3, 3), nn.BatchNorm2d(5), nn.BatchNorm2d(5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv0(x)
        return torch.stack([self.bn1(h).sum((1, 2, 3)), self.bn2(-h).sum((1, 2, 3))], dim=1)


class BatchNormNonLinearNet(nn.Module):
    """nngeometry's ``BatchNormNonLinearNet`` (eval): BatchNorm2d of the image and its
    transpose, BatchNorm1d of the flat image, then a Linear."""

    def __init__(self):
        super().__init__()
        self.bnconv, self.bnfc = nn.BatchNorm2d(2), nn.BatchNorm1d(14 * 14)
        self.fc = nn.Linear(3 * 14 * 14, 5)

    def forward(self, x: Tensor) -> Tensor:
        b = x.size(0)
        two = self.bnconv(torch.cat([x, x.permute(0, 1, 3, 2)], dim=1))
        return self.fc(torch.cat([two.view(b, -1), self.bnfc(x.view(b, -1))], dim=1))


class ConvNetWithSkipConnection(nn.Module):
    """nngeometry's ``ConvNetWithSkipConnection``: four 3x3 convolutions, one skip."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 2, 3, 1, 1), nn.Conv2d(2, 2, 3, 1, 1)
        self.conv3, self.conv4 = nn.Conv2d(2, 2, 3, 1, 1), nn.Conv2d(2, 3, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        before = F.relu(self.conv1(x))
        after = F.relu(self.conv3(F.relu(self.conv2(before))))
        return F.relu(self.conv4(after + before)).sum(dim=(2, 3))


class FCNetSegmentation(nn.Module):
    """nngeometry's ``FCNetSegmentation``: an output per class and pixel, ``[B, 3, 4, 4]``."""

    def __init__(self, out: int = 3):
        super().__init__()
        self.out = out
        self.net = nn.Sequential(nn.Linear(8 * 8, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(),
                                 nn.Linear(10, 4 * 4 * out))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, 3:-3, 3:-3].contiguous()
        return self.net(x.view(x.size(0), -1)).view(-1, self.out, 4, 4)


class EmbeddingLayerNorm(nn.Module):
    """An Embedding, a LayerNorm and a Linear over a sequence (nngeometry's layer collection
    holds Embedding and LayerNorm layers; its ``tests/test_tasks/layernorm.py``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.fc = nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, idx: Tensor) -> Tensor:
        return self.fc(self.ln(self.emb(idx))).mean(1)


class TransposeGroupNorm(nn.Module):
    """A ConvTranspose2d, a GroupNorm and a Linear (nngeometry's ConvTranspose2d layer)."""

    def __init__(self):
        super().__init__()
        self.up, self.gn = nn.ConvTranspose2d(2, 4, 3, stride=2), nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.relu(self.gn(self.up(x))).mean((2, 3)))


def image(size: int):
    return lambda b: torch.rand(b, 1, size, size)


NNGEOMETRY_TASKS = {
    "linear_fc": (LinearFCNet, image(14)),
    "linear_conv": (LinearConvNet, image(14)),
    "batchnorm_fc_linear": (BatchNormFCLinearNet, image(14)),
    "batchnorm_conv_linear": (BatchNormConvLinearNet, image(14)),
    "batchnorm_nonlinear": (BatchNormNonLinearNet, image(14)),
    "fullyconnect": (FCNet, image(14)),
    "fullyconnect_bn": (lambda: FCNet("batch_norm"), image(14)),
    "fullyconnect_wn": (lambda: FCNet("weight_norm"), image(14)),
    "fullyconnect_cosine": (lambda: FCNet("cosine"), image(14)),
    "fullyconnect_affine": (lambda: FCNet("affine"), image(14)),
    "conv": (ConvNet, image(28)),
    "conv_bn": (lambda: ConvNet("batch_norm"), image(28)),
    "conv_gn": (lambda: ConvNet("group_norm"), image(28)),
    "conv_wn": (lambda: ConvNet("weight_norm"), image(28)),
    "small_conv_wn": (SmallConvNet, image(14)),
    "conv_skip": (ConvNetWithSkipConnection, image(8)),
    "embedding_layernorm": (EmbeddingLayerNorm, lambda b: torch.randint(0, 11, (b, 5))),
    "conv_transpose_gn": (TransposeGroupNorm, lambda b: torch.randn(b, 2, 3, 3)),
    "fullyconnect_segm": (FCNetSegmentation, image(14)),
}


def nngeometry_task(name: str, batch: int = 5):
    """The task's network in eval mode and float64 (BatchNorm with non-trivial running
    statistics and affine parameters, as after training), and its inputs."""
    factory, inputs = NNGEOMETRY_TASKS[name]
    model = seeded(factory).double().eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model, as_double(seeded(lambda: inputs(batch), seed=1))


@pytest.mark.parametrize("task", list(NNGEOMETRY_TASKS))
def test_nngeometry_per_example_jacobians(task):
    """The Jacobian of each example's output with respect to every parameter
    (``Jacobian.get_jacobian`` / ``PushForwardDense.get_dense_tensor``, ``[outputs, n, P]``
    there) on nngeometry's task networks: its ``test_jacobian.py`` over ``linear_tasks`` and
    ``nonlinear_tasks`` (and ``test_torch_hooks.py``, the same by hooks)."""
    model, x = nngeometry_task(task)
    want = jacobians_by_jacrev(model, x)
    got = gradhooks.jacobians(model, x)
    assert set(got) == set(want)
    for n in want:
        assert_close(got[n], want[n], f"{task}: {n}")
    assert_close(gradhooks.jacobians(model, x, flatten=True), flat(want, model), f"{task}: flat")


# the parameters in which each linear task's output is linear (nngeometry's layer collections)
LINEAR_IN = {
    "linear_fc": lambda model: list(model.parameters()),
    "linear_conv": lambda model: list(model.parameters()),
    "batchnorm_fc_linear": lambda model: [*model.bn1.parameters(), *model.bn2.parameters()],
    "batchnorm_conv_linear": lambda model: [*model.bn1.parameters(), *model.bn2.parameters()],
    "fullyconnect_onlylast": lambda model: list(model.net[-1].parameters()),
}


@pytest.mark.parametrize("task", list(LINEAR_IN))
def test_nngeometry_push_forward_of_a_linear_model_is_the_change_of_its_output(task):
    """nngeometry's ``test_jacobian_pushforward_dense_linear``: where the output is linear in
    the parameters (the others frozen, as its layer collections keep only these), the
    per-example Jacobian times a step ``dw`` is exactly the change of the output when the
    parameters move by ``dw``."""
    name = "fullyconnect" if task == "fullyconnect_onlylast" else task
    model, x = nngeometry_task(name)
    kept = {id(p) for p in LINEAR_IN[task](model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in kept)
    J = gradhooks.jacobians(model, x, flatten=True)  # [n, outputs, P]
    dw = seeded(lambda: torch.randn(J.shape[-1], dtype=D), seed=4)
    with torch.no_grad():
        before = model(x)
        offset = 0
        for p in model.parameters():
            if p.requires_grad:
                p += dw[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        assert offset == len(dw)
        after = model(x)
    assert_close(J @ dw, (after - before).reshape(len(x), -1), f"{task}: push-forward")


@pytest.mark.parametrize("task", ["linear_fc", "fullyconnect_cosine", "fullyconnect_affine",
                                  "conv_bn", "conv_wn", "conv_skip", "embedding_layernorm",
                                  "conv_transpose_gn"])  # fmt: skip
def test_nngeometry_per_example_gradients_of_the_cross_entropy(task):
    """Per-example gradients of a mean cross-entropy on the task networks (the rows whose
    second moment nngeometry's ``FIM_MonteCarlo`` / ``test_m2gradients.py`` builds)."""
    model, x = nngeometry_task(task)
    y = torch.randint(0, 2 if task.startswith(("linear", "batchnorm")) else 3, (x.shape[0],))
    oracle_check(model, x, lambda out, t: F.cross_entropy(out, t, reduction="sum"), y,
                 reduction="sum", loop=True)  # fmt: skip


@pytest.mark.parametrize("task", ["fullyconnect", "fullyconnect_wn", "conv_gn", "conv_skip"])
def test_nngeometry_fim_of_a_classifier_from_the_jacobians(task):
    """nngeometry's ``FIM(..., variant="classif_logits")`` (``PMatDense``): ``F = 1/n Σ_i
    Σ_y p(y|x_i) ∇log p(y|x_i) ∇log p(y|x_i)ᵀ``, here ``1/n Σ_i J_iᵀ (diag p_i - p_i p_iᵀ) J_i``
    from gradhooks' per-example Jacobians of the logits, against the sum over every class of
    every example, one autograd gradient at a time (its ``test_fim``/``test_pdense`` checks,
    and trace and diagonal of the same matrix)."""
    model, x = nngeometry_task(task, batch=4)
    J = gradhooks.jacobians(model, x, flatten=True)  # [n, C, P]
    with torch.no_grad():
        p = model(x).softmax(-1)
    middle = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    fim = torch.einsum("ncp,ncd,ndq->pq", J, middle, J) / x.shape[0]
    params = list(trainable(model).values())
    want = torch.zeros_like(fim)
    for i in range(x.shape[0]):
        logp = model(x[i : i + 1]).log_softmax(-1)[0]
        for c in range(logp.shape[0]):
            g = torch.cat(
                [t.flatten() for t in torch.autograd.grad(logp[c], params, retain_graph=True)]
            )
            want += logp[c].exp().detach() * torch.outer(g, g)
    want /= x.shape[0]
    assert_close(fim, want, f"{task}: FIM")
    assert_close(fim.diagonal(), want.diagonal(), f"{task}: diagonal")
    assert math.isclose(float(fim.trace()), float(want.trace()), rel_tol=1e-9)


@pytest.mark.parametrize("task", ["linear_conv", "fullyconnect_affine", "small_conv_wn"])
def test_nngeometry_gram_matrix_of_the_jacobians(task):
    """nngeometry's ``FMatDense`` (the Gram matrix ``[n, outputs, n, outputs]`` of the
    per-example Jacobians, ``test_jacobian_fdense_vs_pullback``), its ``vTMv`` and Frobenius
    norm, from gradhooks' Jacobians against those of ``vmap(jacrev)``."""
    model, x = nngeometry_task(task, batch=4)
    J = gradhooks.jacobians(model, x, flatten=True)
    Jw = flat(jacobians_by_jacrev(model, x), model)
    gram, want = torch.einsum("icp,jdp->icjd", J, J), torch.einsum("icp,jdp->icjd", Jw, Jw)
    assert_close(gram, want, f"{task}: Gram")
    v = seeded(lambda: torch.randn(J.shape[0], J.shape[1], dtype=D))
    vJ = torch.einsum("ic,icp->p", v, J)
    assert math.isclose(
        float(vJ @ vJ), float(torch.einsum("ic,icjd,jd->", v, want, v)), rel_tol=1e-9
    )
    assert math.isclose(float(gram.norm()), float(want.norm()), rel_tol=1e-9)


@pytest.mark.parametrize("task", ["fullyconnect", "conv", "embedding_layernorm"])
def test_nngeometry_second_moment_of_the_gradients(task):
    """nngeometry's ``test_m2gradients.py``: the second moment ``1/n Σ_i g_i g_iᵀ`` of the
    per-example gradients of the loss, dense from ``grad1`` and its diagonal from the
    ``"sum_grad_sq"`` quantity (never forming ``grad1``), against the oracle's rows."""
    model, x = nngeometry_task(task)
    y = torch.randint(0, 3, (x.shape[0],))

    def loss(out, t):
        return F.cross_entropy(out, t, reduction="sum")

    want = vmap_grad(model, loss, (x,), y)
    hooked(model, x, loss, y, quantities=("grad1",))
    G = torch.cat([p.grad1.flatten(1) for p in trainable(model).values()], 1)
    Gw = torch.cat([want[n].flatten(1) for n in trainable(model)], 1)
    assert_close(G.T @ G / len(x), Gw.T @ Gw / len(x), f"{task}: second moment")
    model.zero_grad()
    h = hooked(model, x, loss, y, quantities=("sum_grad_sq",))
    for n, s in h.sum_grad_sq().items():
        assert_close(s, want[n].pow(2).sum(0), f"{task}: sum_grad_sq {n}")


# == ASDL: tests/test_unit_wise.py, test_fisher*.py, batch_grads / sum_grad_sqr / data_size ====


def ce_sum(out, t):
    return F.cross_entropy(out, t, reduction="sum")


def unit_wise(weight: Tensor, bias: Tensor) -> Tensor:
    """``[n, out, in + 1]``: each output unit's row of the weight with its bias appended."""
    return torch.cat([weight, bias.unsqueeze(-1)], -1)


@pytest.mark.parametrize("same_inputs", [True, False], ids=["repeated-input", "distinct"])
def test_asdl_unit_wise_empirical_fisher_of_a_linear(same_inputs):
    """ASDL's ``test_unit_wise.py`` (``fisher_for_cross_entropy`` with ``FISHER_EMP`` and
    ``SHAPE_UNIT_WISE``): for each output unit ``j`` of a Linear, the ``[in+1, in+1]`` mean of
    ``u_ij u_ijᵀ`` over the examples, ``u_ij`` being unit ``j``'s weight row and bias of
    example ``i``'s gradient. From ``grad1``, against the same from the per-example loop
    (ASDL's test hard-codes the matrix of two equal inputs; both settings here)."""
    layer = seeded(lambda: nn.Linear(2, 2)).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [4.0, 3.0]]))
        layer.bias.copy_(torch.tensor([0.1, -0.1]))
    x = torch.tensor([[-0.5, 0.6]] * 2 if same_inputs else [[-0.5, 0.6], [0.3, -1.2]], dtype=D)
    y = torch.tensor([0, 0] if same_inputs else [0, 1])
    want = loop_grad(layer, ce_sum, (x,), y)
    with gradhooks.add_hooks(layer, loss_reduction="mean"):
        F.cross_entropy(layer(x), y).backward()
    u = unit_wise(layer.weight.grad1, layer.bias.grad1)
    w = unit_wise(want["weight"], want["bias"])
    got = torch.einsum("nja,njb->jab", u, u) / len(x)
    assert_close(got, torch.einsum("nja,njb->jab", w, w) / len(x), "unit-wise Fisher")
    if same_inputs:  # (two equal examples: the mean is either one's outer product)
        assert_close(got, torch.einsum("ja,jb->jab", w[0], w[0]), "one example's")


class AsdlBias(nn.Module):
    """ASDL's ``Bias`` module: ``x + bias`` (a trainable vector, no rule of its own)."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight


class AsdlScale(nn.Module):
    """ASDL's ``Scale`` module: ``x * scale`` (a trainable vector, no rule of its own)."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


ASDL_MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), (6,)),
    "conv2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)),
        (2, 4, 4),
    ),
    "batchnorm_eval": (
        lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).eval(),
        (6,),
    ),
    "layernorm": (lambda: nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)), (6,)),
    "bias_scale": (
        lambda: nn.Sequential(
            nn.Linear(6, 5), AsdlBias(5), AsdlScale(5), nn.Tanh(), nn.Linear(5, 3)
        ),
        (6,),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(ASDL_MODELS))
def test_asdl_batch_grads_of_each_module_kind(name):
    """ASDL's ``batch_gradient`` / ``save_batch_grads`` (``op_results["batch_grads"]``) over
    its supported modules (Linear, Conv2d, BatchNorm, LayerNorm, its ``Bias`` and ``Scale``),
    under the mean cross-entropy ASDL's Fisher tests use: ``grad1`` against both oracles."""
    factory, shape = ASDL_MODELS[name]
    model = seeded(factory)
    x, y = seeded(lambda: (torch.randn(5, *shape), torch.randint(0, 3, (5,))), seed=2)
    oracle_check(model, x, lambda out, t: F.cross_entropy(out, t), y, reduction="mean", loop=True)


@pytest.mark.parametrize("sizes", [(4, 4, 2), (1, 6, 3)], ids=["4-4-2", "1-6-3"])
def test_asdl_fisher_over_a_data_loader_equals_the_full_batch(sizes):
    """ASDL's ``test_fisher_dataloader.py`` (and ``data_size``): the empirical Fisher's
    diagonal (``sum_grad_sqr``) accumulated over the batches of a loader, each under a mean
    loss of its own size, divided by the number of examples, equals the one of the whole data
    set; and the batch gradients' full empirical Fisher too. Against the oracle's rows."""
    model = seeded(ASDL_MODELS["conv2d"][0]).double()
    n = sum(sizes)
    x, y = seeded(lambda: (torch.randn(n, 2, 4, 4, dtype=D), torch.randint(0, 3, (n,))), seed=3)
    want = vmap_grad(model, ce_sum, (x,), y)
    total = {name: torch.zeros_like(p) for name, p in trainable(model).items()}
    rows = []
    start = 0
    for size in sizes:
        xb, yb = x[start : start + size], y[start : start + size]
        start += size
        h = hooked(model, xb, lambda out, t: F.cross_entropy(out, t), yb, "mean",
                   quantities=("grad1", "sum_grad_sq"))  # fmt: skip
        for name, s in h.sum_grad_sq().items():
            total[name] += s
        rows.append(torch.cat([p.grad1.flatten(1) for p in trainable(model).values()], 1))
        model.zero_grad(set_to_none=True)
    for name in total:
        assert_close(total[name] / n, want[name].pow(2).mean(0), f"diagonal {name}")
    G = torch.cat(rows)
    Gw = torch.cat([want[name].flatten(1) for name in trainable(model)], 1)
    assert_close(G.T @ G / n, Gw.T @ Gw / n, "empirical Fisher")


# == BackPACK: BatchL2Grad, SumGradSquared, Variance on more modules; custom modules ===========


class ScaleModule(nn.Module):
    """BackPACK's ``custom_module.scale_module.ScaleModule``: ``x * weight``, a constant."""

    def __init__(self, weight: float = 2.0):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class TrainableScale(nn.Module):
    """A custom module with a trainable scalar (BackPACK's "extend your own module" example,
    ``ScaleModule`` whose weight is a parameter): no rule, so gradhooks' ``torch.func``
    fallback recomputes it per example."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


BACKPACK_MODULES = {
    "conv_transpose1d": (lambda: nn.Sequential(nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1),
                                               nn.Flatten(), nn.Linear(63, 4)), (2, 11)),
    "conv_transpose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(2, 3, 2, stride=2, groups=1,
                                                                  dilation=1), nn.ReLU(),
                                               nn.Flatten(), nn.Linear(3 * 36, 4)), (2, 3, 3)),
    "conv_transpose2d_groups_dilation": (
        lambda: nn.Sequential(nn.ConvTranspose2d(4, 2, 3, stride=1, padding=1, groups=2,
                                                 dilation=2), nn.Flatten(), nn.Linear(50, 4)),
        (4, 3, 3)),
    "conv_transpose3d": (lambda: nn.Sequential(nn.ConvTranspose3d(2, 2, 2, stride=2),
                                               nn.Flatten(), nn.Linear(2 * 64, 4)), (2, 2, 2, 2)),
    "batchnorm1d_eval": (lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(),
                                               nn.Linear(6, 4)).eval(), (5,)),
    "batchnorm2d_eval": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3),
                                               nn.Flatten(), nn.Linear(27, 4)).eval(), (2, 4, 4)),
    "batchnorm3d_eval": (lambda: nn.Sequential(nn.BatchNorm3d(2), nn.Flatten(),
                                               nn.Linear(2 * 27, 4)).eval(), (2, 3, 3, 3)),
    "scale_module": (lambda: nn.Sequential(nn.Linear(5, 6), ScaleModule(0.5), nn.Sigmoid(),
                                           nn.Linear(6, 4)), (5,)),
    "trainable_scale": (lambda: nn.Sequential(nn.Linear(5, 6), TrainableScale(), nn.Tanh(),
                                              nn.Linear(6, 4)), (5,)),
}  # fmt: skip


class EmbeddingClassifier(nn.Module):
    """BackPACK's ``Embedding`` setting: an Embedding over a sequence, summed, then a Linear."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 5, padding_idx=0), nn.Linear(5, 4)

    def forward(self, idx: Tensor) -> Tensor:
        return self.fc(self.emb(idx).sum(1))


def backpack_problem(name: str, batch: int = 5):
    if name == "embedding":
        model = seeded(EmbeddingClassifier).double()
        x = seeded(lambda: torch.randint(0, 10, (batch, 6)), seed=1)
    else:
        factory, shape = BACKPACK_MODULES[name]
        model = seeded(factory).double()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        x = seeded(lambda: torch.randn(batch, *shape, dtype=D), seed=1)
    return model, x


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", [*BACKPACK_MODULES, "embedding"])
def test_backpack_batch_l2_sum_grad_squared_and_variance(name, reduction):
    """BackPACK's ``BatchL2Grad``, ``SumGradSquared`` and ``Variance`` (``test/extensions/
    firstorder/{batch_l2_grad,sum_grad_squared,variance}``) on ConvTranspose1d/2d/3d,
    BatchNorm in eval mode, Embedding and custom modules, under a cross-entropy with
    ``reduction="mean"`` and ``"sum"``; the norms and squared sums computed without forming
    ``grad1``. gradhooks' quantities are of each example's own loss whatever the reduction
    (BackPACK's carry ``1/N²`` under a mean); ``grad_variance`` is the population variance."""
    model, x = backpack_problem(name)
    y = seeded(lambda: torch.randint(0, 4, (x.shape[0],)), seed=2)
    want = vmap_grad(model, ce_sum, (x,), y)
    h = hooked(model, x, lambda out, t: F.cross_entropy(out, t, reduction=reduction), y,
               reduction, quantities=("norms", "sum_grad_sq"))  # fmt: skip
    norms, sgs, var = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    assert set(norms) == set(sgs) == set(var) == set(want)
    for n, g in want.items():
        assert_close(norms[n] ** 2, g.reshape(len(g), -1).pow(2).sum(1), f"{name} BatchL2Grad {n}")
        assert_close(sgs[n], g.pow(2).sum(0), f"{name} SumGradSquared {n}")
        assert_close(var[n], g.pow(2).mean(0) - g.mean(0) ** 2, f"{name} Variance {n}")
    total = torch.cat([g.reshape(len(g), -1) for g in want.values()], 1).norm(dim=1)
    assert_close(h.norms(), total, f"{name}: whole-model norms")


class Permute(nn.Module):
    """BackPACK's ``custom_module.permute.Permute``."""

    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(*self.dims)


class Pad(nn.Module):
    """BackPACK's ``custom_module.pad.Pad`` (``F.pad`` with a mode and value)."""

    def __init__(self, pad, mode="constant", value=0.0):
        super().__init__()
        self.pad, self.mode, self.value = pad, mode, value

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, self.pad, mode=self.mode, value=self.value)


class Slicing(nn.Module):
    """BackPACK's ``custom_module.slicing.Slicing`` (an index tuple)."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, x: Tensor) -> Tensor:
        return x[self.index]


class Branch(nn.Module):
    """BackPACK's ``custom_module.branching.Branch``: the input through each child, a tuple of
    their outputs."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(b(x) for b in self.branches)


class Merge(nn.Module):
    """BackPACK's ``custom_module.branching.Merge``: the sum of a tuple of tensors."""

    def forward(self, xs: tuple[Tensor, ...]) -> Tensor:
        return sum(xs)


def parallel(*branches: nn.Module) -> nn.Sequential:
    """BackPACK's ``custom_module.branching.Parallel``: ``Branch`` then ``Merge``."""
    return nn.Sequential(Branch(*branches), Merge())


CUSTOM_MODULE_MODELS = {
    "permute": lambda: nn.Sequential(nn.Conv1d(2, 3, 2), Permute(0, 2, 1), nn.Linear(3, 4),
                                     Permute(0, 2, 1), nn.Flatten(), nn.Linear(4 * 5, 3)),
    "pad": lambda: nn.Sequential(nn.Conv2d(2, 3, 2), Pad((1, 1, 2, 0), value=0.5),
                                 nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(2 * 5 * 5, 3)),
    "pad_reflect": lambda: nn.Sequential(nn.Conv1d(2, 3, 2), Pad((2, 1), mode="reflect"),
                                         nn.Flatten(), nn.Linear(3 * 8, 3)),
    "slicing": lambda: nn.Sequential(nn.Conv2d(2, 3, 2), Slicing((slice(None), slice(1, 3),
                                                                   slice(None, None, 2))),
                                     nn.Flatten(), nn.Linear(2 * 2 * 7, 3)),
    "branch_sum": lambda: nn.Sequential(nn.Linear(6, 4), parallel(nn.Identity(), ScaleModule(0.3),
                                                                nn.Sequential(nn.Tanh(),
                                                                              nn.Linear(4, 4))),
                                        nn.Linear(4, 3)),
}  # fmt: skip

CUSTOM_MODULE_INPUTS = {"permute": (2, 6), "pad": (2, 5, 5), "pad_reflect": (2, 6),
                        "slicing": (2, 5, 8), "branch_sum": (6,)}  # fmt: skip


@pytest.mark.parametrize("name", list(CUSTOM_MODULE_MODELS))
def test_backpack_custom_modules_between_hooked_layers(name):
    """Networks with BackPACK's custom modules (``Permute``, ``Pad``, ``Slicing``, ``Parallel``: a
    ``Branch`` into a tuple summed by ``Merge``, ``ScaleModule``) between Linear and
    convolution layers: its ``test/extensions/firstorder/batch_grad`` settings with these
    modules (``BatchGrad``), and the same model's norms (``BatchL2Grad``)."""
    model = seeded(CUSTOM_MODULE_MODELS[name])
    x = seeded(lambda: torch.randn(4, *CUSTOM_MODULE_INPUTS[name]), seed=1)
    y = seeded(lambda: torch.randint(0, 3, (4,)), seed=2)
    want = oracle_check(model, x, ce_sum, y, reduction="sum")
    h = hooked(model, as_double(x), ce_sum, y, quantities=("norms",))
    for n, g in want.items():
        assert_close(h.param_norms()[n], g.reshape(len(g), -1).norm(dim=1), f"{name}: norms {n}")


@pytest.mark.parametrize("subsampling", [[0], [1, 3], [4, 0, 2]], ids=str)
def test_backpack_batch_grad_with_subsampling(subsampling):
    """BackPACK's ``BatchGrad(subsampling=...)`` (``test/extensions/firstorder/batch_grad/
    test_batch_grad.py`` with ``subsampling``): the per-example gradients of the chosen
    examples only, in the chosen order, from one backward of the whole batch. In gradhooks,
    rows of ``grad1``: each equal to the oracle run on the chosen examples alone (the others
    change nothing in them)."""
    model, x = backpack_problem("conv_transpose2d")
    y = seeded(lambda: torch.randint(0, 4, (x.shape[0],)), seed=2)
    hooked(model, x, lambda out, t: F.cross_entropy(out, t), y, "mean")
    chosen = torch.tensor(subsampling)
    want = vmap_grad(model, ce_sum, (x[chosen],), y[chosen])
    for n, p in trainable(model).items():
        assert_close(p.grad1[chosen], want[n], f"subsampling {subsampling}: {n}")


# == Opacus: grad_samples/ for its DP layers, instance norm, RMSNorm ============================


class DPRNNLayer(nn.Module):
    """Opacus' ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` (``opacus/layers/dp_rnn.py``), rewritten:
    one direction of one layer, its cell made of two ``Linear`` (``ih``, ``hh``) called once
    per time step, ``[T, B, H]`` in and out (time-major)."""

    def __init__(self, kind: str, fan_in: int, hidden: int, bias: bool, reverse: bool):
        super().__init__()
        gates = {"lstm": 4, "gru": 3, "rnn": 1}[kind]
        self.kind, self.hidden, self.reverse = kind, hidden, reverse
        self.ih = nn.Linear(fan_in, gates * hidden, bias=bias)
        self.hh = nn.Linear(hidden, gates * hidden, bias=bias)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> Tensor:
        h, c = state
        outs = []
        steps = range(x.shape[0] - 1, -1, -1) if self.reverse else range(x.shape[0])
        for t in steps:
            a, b = self.ih(x[t]), self.hh(h)
            if self.kind == "lstm":
                i, f, g, o = (a + b).chunk(4, -1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
            elif self.kind == "gru":
                ar, az, an = a.chunk(3, -1)
                br, bz, bn = b.chunk(3, -1)
                r, z = torch.sigmoid(ar + br), torch.sigmoid(az + bz)
                h = (1 - z) * torch.tanh(an + r * bn) + z * h
            else:
                h = torch.tanh(a + b)
            outs.append(h)
        return torch.stack(outs[::-1] if self.reverse else outs)


class DPRNN(nn.Module):
    """Layers of :class:`DPRNNLayer`, optionally bidirectional, with an initial state and
    ``batch_first``; the output of every step."""

    def __init__(self, kind, fan_in, hidden, layers=1, bidirectional=False, bias=True,
                 batch_first=False):  # fmt: skip
        super().__init__()
        self.batch_first, self.hidden = batch_first, hidden
        dirs = 2 if bidirectional else 1
        self.cells = nn.ModuleList(
            DPRNNLayer(kind, fan_in if layer == 0 else dirs * hidden, hidden, bias, bool(d))
            for layer in range(layers)
            for d in range(dirs)
        )
        self.dirs = dirs

    def forward(self, x: Tensor, h0: Tensor) -> Tensor:
        if self.batch_first:
            x = x.transpose(0, 1)
        for k in range(0, len(self.cells), self.dirs):
            x = torch.cat(
                [cell(x, (h0[k + d], torch.tanh(h0[k + d]))) for d, cell in
                 enumerate(self.cells[k : k + self.dirs])], -1)  # fmt: skip
        return x.transpose(0, 1) if self.batch_first else x


class BatchFirst(nn.Module):
    """The examples on dimension 0 of every input and of the output (for the oracle's
    ``vmap``), moved to dimension 1 where the wrapped time-major module wants them (``moved``
    says which inputs; ``extra`` are passed after them as they are)."""

    def __init__(self, inner: nn.Module, moved: tuple[bool, ...], *extra: Tensor):
        super().__init__()
        self.inner, self.moved, self.extra = inner, moved, extra

    def forward(self, *xs: Tensor) -> Tensor:
        xs = tuple(x.transpose(0, 1) if m else x for x, m in zip(xs, self.moved, strict=True))
        out = self.inner(*xs, *(e.to(xs[0].dtype) for e in self.extra))
        return out if getattr(self.inner, "batch_first", False) else out.transpose(0, 1)


DP_RNN_SETTINGS = [
    ("lstm", dict()),
    ("lstm", dict(layers=2, bidirectional=True)),
    ("gru", dict(bias=False)),
    ("gru", dict(layers=2)),
    ("rnn", dict(bidirectional=True)),
    ("lstm", dict(batch_first=True)),
]


@pytest.mark.parametrize("kind,kw", DP_RNN_SETTINGS, ids=lambda v: str(v))
def test_opacus_dp_rnn_layers_built_from_linear_cells(kind, kw):
    """Opacus' ``tests/grad_samples/dp_rnn_test.py`` and ``dp_layers/dp_rnn_test.py``:
    ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` over layers, directions, bias, ``batch_first`` and an
    initial state, each cell's ``Linear`` called at every time step (a module reused T times
    in one forward), against the oracle (the examples of a time-major run on dimension 1)."""
    rnn = seeded(lambda: DPRNN(kind, 3, 4, **kw))
    dirs = 2 if kw.get("bidirectional") else 1
    layers = kw.get("layers", 1)
    x = seeded(lambda: torch.randn(3, 5, 3), seed=1)  # [B, T, F]
    h0 = seeded(lambda: torch.randn(3, layers * dirs, 4), seed=2)  # [B, L·D, H]
    model = BatchFirst(rnn, (not kw.get("batch_first"), True))
    oracle_check(model, (x, h0), loop=True)


class DPMultiheadAttention(nn.Module):
    """Opacus' ``DPMultiheadAttention`` (``opacus/layers/dp_multihead_attention.py``),
    rewritten: separate ``Linear`` for q, k, v and the output, ``add_bias_kv`` (a key and a
    value appended to every sequence), ``add_zero_attn`` (a zero key and value appended),
    ``kdim`` / ``vdim``; time-major ``[T, B, E]``."""

    def __init__(self, embed, heads, kdim=None, vdim=None, add_bias_kv=False, add_zero_attn=False):
        super().__init__()
        self.embed, self.heads, self.add_zero_attn = embed, heads, add_zero_attn
        self.qlinear = nn.Linear(embed, embed)
        self.klinear = nn.Linear(kdim or embed, embed)
        self.vlinear = nn.Linear(vdim or embed, embed)
        self.out_proj = nn.Linear(embed, embed)
        if add_bias_kv:
            self.seq_bias_k = nn.Linear(1, embed, bias=False)  # (Opacus' SequenceBias)
            self.seq_bias_v = nn.Linear(1, embed, bias=False)
        self.add_bias_kv = add_bias_kv

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        T, B, E = q.shape
        q, k, v = self.qlinear(q), self.klinear(k), self.vlinear(v)
        if self.add_bias_kv:
            one = q.new_ones(1, B, 1)
            k = torch.cat([k, self.seq_bias_k(one)])
            v = torch.cat([v, self.seq_bias_v(one)])
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(1, B, E)])
            v = torch.cat([v, v.new_zeros(1, B, E)])
        head = E // self.heads

        def split(t):
            return t.reshape(t.shape[0], B * self.heads, head).transpose(0, 1)

        scores = split(q) @ split(k).transpose(1, 2) / math.sqrt(head)
        if mask is not None:
            pad = scores.shape[-1] - mask.shape[-1]
            scores = scores + F.pad(mask, (0, pad))
        out = (scores.softmax(-1) @ split(v)).transpose(0, 1).reshape(T, B, E)
        return self.out_proj(out)


MHA_SETTINGS = [
    dict(),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=3, vdim=5),
]


@pytest.mark.parametrize("kw", MHA_SETTINGS, ids=lambda kw: ",".join(kw) or "plain")
def test_opacus_dp_multihead_attention(kw):
    """Opacus' ``tests/grad_samples/dp_multihead_attention_test.py`` over ``add_bias_kv``,
    ``add_zero_attn``, ``kdim`` / ``vdim`` (and a causal mask), on time-major inputs."""
    mha = seeded(lambda: DPMultiheadAttention(4, 2, **kw))
    S = 3
    q = seeded(lambda: torch.randn(3, S, 4), seed=1)
    k = seeded(lambda: torch.randn(3, S + 1, kw.get("kdim", 4)), seed=2)
    v = seeded(lambda: torch.randn(3, S + 1, kw.get("vdim", 4)), seed=3)
    mask = torch.zeros(S, S + 1).masked_fill(torch.ones(S, S + 1).triu(2).bool(), float("-inf"))
    model = BatchFirst(mha, (True, True, True), mask)
    oracle_check(model, (q, k, v), loop=True)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("affine", [True, False])
def test_opacus_instance_norm(dims, affine):
    """Opacus' ``tests/grad_samples/instance_norm{1,2,3}d_test.py`` (statistics of each
    example's own channels, so training mode is per-example), with a convolution before it
    for the ``affine=False`` case to have a parameter."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    norm = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1]
    model = seeded(lambda: nn.Sequential(conv(2, 4, 2), norm(4, affine=affine)))
    if affine:
        nn.init.uniform_(model[1].weight, 0.5, 1.5)
        nn.init.uniform_(model[1].bias, -0.5, 0.5)
    x = seeded(lambda: torch.randn(3, 2, *([5, 4, 3][:dims])), seed=1)
    oracle_check(model.train(), x, loss=lambda out: (out[:, :1] ** 3).sum())


@pytest.mark.parametrize("shape,normalized", [((4, 6), 6), ((3, 5, 6), (5, 6)),
                                              ((3, 2, 2, 6), 6)], ids=str)  # fmt: skip
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_opacus_rms_norm(shape, normalized, eps):
    """Opacus' ``tests/grad_samples/rms_norm_test.py``: ``nn.RMSNorm`` over one or two
    trailing dimensions, with and without ``eps``, its weight per example."""
    model = seeded(lambda: nn.RMSNorm(normalized, eps=eps))
    nn.init.uniform_(model.weight, 0.5, 1.5)
    x = seeded(lambda: torch.randn(*shape), seed=1)
    oracle_check(model, x, loss=lambda out: (out.sin() * out).sum())


# == dp-transformers: tests/test_grad_sample/*, its private collator, DPTrainer ==================


def bart_positions():
    from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding

    return BartLearnedPositionalEmbedding


class TokensWithPositions(nn.Module):
    """Token embeddings plus BART's learned positional embeddings, then a Linear: the
    positions given (``position_ids`` ``[T]``, shared by every example: an output ``[1, T,
    E]`` broadcast over the batch) or made by the layer (``arange(T).expand(B, -1)``)."""

    def __init__(self, given: bool):
        super().__init__()
        self.tok = nn.Embedding(12, 4)
        self.pos = bart_positions()(10, 4)
        self.fc = nn.Linear(4, 3)
        self.given = given

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1]) if self.given else None
        return self.fc(torch.tanh(self.tok(ids) + self.pos(ids, position_ids=positions)))


@pytest.mark.parametrize("batch", [1, 4])
def test_dp_transformers_bart_learned_positional_embedding_alone_is_refused(batch):
    """dp-transformers' ``test_transformers_pos_emb.py`` runs BART's learned positional
    embedding alone (an Embedding subclass whose forward makes the positions from the
    input's shape, ``arange(T).expand(B, -1)``, plus an offset) and takes row ``i`` of its
    output as example ``i``'s. Its output is made from no example's values: gradhooks cannot
    tell that row ``i`` is example ``i``'s rather than a term shared by all, and refuses by
    name, leaving no ``grad1`` (inside a model, where the output meets the tokens, the next
    test gets each example's gradient)."""
    pytest.importorskip("transformers")
    layer = seeded(lambda: bart_positions()(10, 3)).double()
    x = seeded(lambda: torch.randint(0, 9, (batch, 3)), seed=1)
    with gradhooks.add_hooks(layer, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError, match="BartLearnedPositionalEmbedding"):
            sq(layer(x)).backward()
    assert not hasattr(layer.weight, "grad1") and layer.weight.grad is None


@pytest.mark.parametrize("given", [False, True], ids=["made", "given"])
def test_dp_transformers_positional_embedding_inside_a_model(given):
    """The same layer inside a model, its positions made from the input or given once for
    every example (an output of one row, broadcast over the batch: each example's gradient
    is its own share of it)."""
    pytest.importorskip("transformers")
    model = seeded(lambda: TokensWithPositions(given))
    x = seeded(lambda: torch.randint(0, 12, (4, 5)), seed=1)
    y = seeded(lambda: torch.randint(0, 3, (4, 5)), seed=2)
    oracle_check(model, x, lambda out, t: F.cross_entropy(out.transpose(1, 2), t, reduction="sum"),
                 y, loop=True)  # fmt: skip


@pytest.mark.parametrize("shape", [(1, 16), (24, 16, 8)], ids=["1x16", "24x16x8"])
def test_dp_transformers_t5_layer_norm(shape):
    """dp-transformers' ``test_transformers_t5_layer_norm.py``: T5's layer norm (a scale
    only, the variance without the mean) on ``[1, 16]`` and ``[24, 16, 8]``."""
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    layer = seeded(lambda: T5LayerNorm(shape[-1]))
    nn.init.uniform_(layer.weight, 0.5, 1.5)
    x = seeded(lambda: torch.randn(*shape), seed=1)
    oracle_check(layer, x, loss=lambda out: (out.sin() * out).sum())


class MergedLoRA(nn.Module):
    """dp-transformers' ``DPMergedLinear`` (``layers/dp_merged_linear.py``), rewritten: a
    frozen ``Linear(in, 3·out)`` for q, k, v, and a LoRA update of the parts ``enable_lora``
    picks: ``lora_A`` a ``Linear(in, r·k)``, ``lora_B`` its ``Conv1DZeroInit`` (a grouped
    ``Conv1d`` of kernel 1, one group per enabled part), the update scattered into the
    enabled parts and scaled by ``alpha / r``."""

    def __init__(self, fan_in, out, r, alpha, enable_lora, train_base=False):
        super().__init__()
        k = sum(enable_lora)
        self.linear = nn.Linear(fan_in, out, bias=True)
        self.linear.weight.requires_grad_(train_base)
        self.lora_A = nn.Linear(fan_in, r * k, bias=False)
        self.lora_B = nn.Conv1d(r * k, out // len(enable_lora) * k, 1, groups=k, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # (zero at first in earnest)
        part = out // len(enable_lora)
        idx = torch.cat([torch.arange(i * part, (i + 1) * part)
                         for i, on in enumerate(enable_lora) if on])  # fmt: skip
        self.register_buffer("idx", idx)
        self.out, self.scaling = out, alpha / r

    def forward(self, x: Tensor) -> Tensor:
        after_a = self.lora_A(x)  # [B, T, r·k]
        after_b = self.lora_B(after_a.transpose(1, 2)).transpose(1, 2)  # [B, T, part·k]
        update = x.new_zeros(*x.shape[:-1], self.out).index_copy(-1, self.idx, after_b)
        return self.linear(x) + self.scaling * update


@pytest.mark.parametrize("enable_lora", [[True, False, False], [True, False, True],
                                         [True, True, True]], ids=str)  # fmt: skip
@pytest.mark.parametrize("train_base", [False, True], ids=["base-frozen", "base-trained"])
def test_dp_transformers_merged_lora_linear(enable_lora, train_base):
    """dp-transformers' ``test_lora_conv_1d_zero_init.py``: ``Conv1DZeroInit`` and
    ``DPMergedLinear`` over ``enable_lora`` (LoRA on q only, on q and v, on all three), with
    the base weight frozen (its fine-tuning setting) or trained (its test's)."""
    model = seeded(lambda: MergedLoRA(6, 12, 2, 4, enable_lora, train_base))
    x = seeded(lambda: torch.randn(3, 5, 6), seed=1)
    oracle_check(model, x, loss=lambda out: (out.tanh() * out).sum())


def test_dp_transformers_conv1d_zero_init_alone():
    """``Conv1DZeroInit`` alone: a grouped kernel-1 ``Conv1d`` on ``[B, r·k, T]``, batches of
    1 and 8 (dp-transformers' test over ``batch_size`` and ``seq_len``)."""
    for batch in (1, 8):
        conv = seeded(lambda: nn.Conv1d(2 * 3, 4 * 3, 1, groups=3, bias=False))
        x = seeded(lambda b=batch: torch.randn(b, 6, 7), seed=1)
        oracle_check(conv, x)


def tiny_gpt2(lora: bool):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if lora:
        peft = pytest.importorskip("peft")
        lora_config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, fan_in_fan_out=True,
                                      target_modules=["c_attn"], init_lora_weights=False)  # fmt: skip
        model = peft.get_peft_model(model, lora_config)
    return model.double()


class PrivateCollatorLM(nn.Module):
    """A causal LM called as dp-transformers' ``DataCollatorForPrivateCausalLanguageModeling``
    feeds it: ``position_ids`` ``arange(T).repeat(B, 1)``, one row per example; each
    example's loss its mean next-token cross-entropy."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
        return self.lm(input_ids=ids, position_ids=positions).logits


def causal_lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """The sum over the examples of each one's mean next-token cross-entropy."""
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(1).sum()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dp_transformers_gpt2_with_the_private_collators_position_ids(lora):
    """GPT-2 (fully trained, or its LoRA adapter on ``c_attn`` as in dp-transformers'
    ``fine-tune-dp.py``) with the ``position_ids`` of its private collator: per-example
    gradients against the oracle."""
    model = PrivateCollatorLM(tiny_gpt2(lora))
    ids = seeded(lambda: torch.randint(0, 16, (3, 6)), seed=1)
    oracle_check(model, ids, causal_lm_loss, ids)


class PrivateCollator:
    """dp-transformers' ``DataCollatorForPrivateCausalLanguageModeling``, rewritten: the
    examples stacked, ``labels`` the tokens (``-100`` on the padding), and ``position_ids``
    ``arange(T).repeat(B, 1)``."""

    def __call__(self, items: list[dict]) -> dict[str, Tensor]:
        ids = torch.stack([it["input_ids"] for it in items])
        mask = torch.stack([it["attention_mask"] for it in items])
        positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "position_ids": positions}  # fmt: skip


class Padded(torch.utils.data.Dataset):
    """Token sequences of unequal lengths, right-padded."""

    def __init__(self, n: int, length: int = 6):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 16, (n, length), generator=g)
        self.lengths = torch.randint(3, length + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        return {"input_ids": self.ids[i], "attention_mask": mask}


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_dp_transformers_trainer_step_of_gpt2_lora_with_its_collator(tmp_path):
    """dp-transformers' ``fine-tune-dp.py`` (``OpacusDPTrainer`` with its private collator,
    GPT-2 with a LoRA adapter) as gradhooks' ``DPTrainer``: one step, without noise, is
    ``-lr · Σ_i min(1, C/‖g_i‖) g_i / L`` over the examples drawn, ``g_i`` the gradient of
    example ``i``'s own mean token loss run alone, in float64; the frozen weights unchanged."""
    pytest.importorskip("dp_accounting")
    transformers = pytest.importorskip("transformers")
    from gradhooks.hf import DPArguments, DPTrainer

    model, data, collate = tiny_gpt2(lora=True), Padded(16), PrivateCollator()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    drawn: list[Tensor] = []

    class Recording(DPTrainer):
        def per_example_losses(self, model, inputs):
            drawn.extend(inputs["input_ids"])
            return super().per_example_losses(model, inputs)

    clip, lr, expected = 0.05, 0.5, 4
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=expected, max_steps=1, optim="sgd",
        learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0,
        remove_unused_columns=False,
    )  # fmt: skip
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=1)
    Recording(model, args, train_dataset=data, data_collator=collate, dp=dp).train()
    rows = [next(i for i in range(len(data)) if torch.equal(data.ids[i], r)) for r in drawn]
    assert len(rows) >= 2, rows
    params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in rows:
        batch = collate([data[i]])
        logits = reference(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        labels = batch["labels"][0]
        keep = labels[1:] != -100
        loss = F.cross_entropy(logits[:-1][keep], labels[1:][keep])
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        norms.append(norm)
        for n, g in zip(params, grads, strict=True):
            total[n] += min(1.0, clip / norm) * g
    assert min(norms) < clip < max(norms), norms  # (some clipped, some not)
    for n, p in model.named_parameters():
        if n in params:
            torch.testing.assert_close(p.detach() - before[n], -lr * total[n] / expected,
                                       rtol=1e-7, atol=1e-12, msg=n)  # fmt: skip
        else:
            assert torch.equal(p.detach(), before[n]), f"frozen {n} changed"


# == Opacus: privacy_engine_test.py (against vanilla training), accountants_test.py ============


class SampleConvNet(nn.Module):
    """Opacus' ``SampleConvNet`` of its privacy-engine tests, smaller: Conv2d, GroupNorm,
    pooling, Conv2d, Linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.gn = nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)
        self.conv2, self.fc = nn.Conv2d(4, 4, 2), nn.Linear(36, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.gn(self.conv1(x))), 2)
        return self.fc(F.relu(self.conv2(x)).flatten(1))


class SampleLSTMNet(nn.Module):
    """An Embedding, an LSTM and a Linear (Opacus' privacy-engine test of its DPLSTM)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(10, 4), nn.LSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, idx: Tensor) -> Tensor:
        return self.fc(self.lstm(self.emb(idx))[0][:, -1])


PRIVACY_ENGINE_NETS = {
    "conv": (SampleConvNet, lambda g: torch.randn(6, 1, 10, 10, generator=g, dtype=D)),
    "lstm": (SampleLSTMNet, lambda g: torch.randint(0, 10, (6, 4), generator=g)),
}


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("net", list(PRIVACY_ENGINE_NETS))
def test_opacus_dp_optimizer_without_noise_or_clipping_is_vanilla_training(net, method):
    """Opacus' ``privacy_engine_test.py`` ``test_compare_to_vanilla``: with no noise and a
    clipping norm no gradient reaches, three DP steps of AdamW over fixed batches are the
    vanilla steps of the batch's mean loss (``DPOptimizer`` with ``expected_batch_size`` the
    batch's size), for each way of clipping."""
    factory, inputs = PRIVACY_ENGINE_NETS[net]
    dp_model, plain = seeded(factory).double(), seeded(factory).double()
    g = torch.Generator().manual_seed(1)
    batches = [(inputs(g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    h = gradhooks.add_hooks(dp_model, quantities=quantities)
    opt = gradhooks.DPOptimizer(torch.optim.AdamW(dp_model.parameters(), lr=0.05), h,
                                max_grad_norm=1e6, noise_multiplier=0.0, expected_batch_size=6,
                                method=method)  # fmt: skip
    vanilla = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for x, y in batches:
        opt.backward(F.cross_entropy(dp_model(x), y, reduction="none"))
        opt.step()
        opt.zero_grad()
        vanilla.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        vanilla.step()
    h.remove()
    for (n, a), b in zip(dp_model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=n)


def gaussian_delta(epsilon: float, sigma: float) -> float:
    """δ(ε) of the Gaussian mechanism of sensitivity 1 and noise ``σ``, exactly (Balle and
    Wang 2018, Theorem 8): ``Φ(1/(2σ) - εσ) - e^ε Φ(-1/(2σ) - εσ)``."""

    def phi(t: float) -> float:
        return 0.5 * math.erfc(-t / math.sqrt(2))

    return phi(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * phi(
        -0.5 / sigma - epsilon * sigma
    )


def gaussian_epsilon(delta: float, sigma: float) -> float:
    """The exact ε of the Gaussian mechanism at ``δ``, by bisection of :func:`gaussian_delta`
    (decreasing in ε)."""
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_delta(mid, sigma) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 16), (0.8, 4), (5.0, 100)])
def test_opacus_accountants_against_the_exact_gaussian_mechanism(sigma, steps):
    """Opacus' ``accountants_test.py`` checks its RDP and PRV accountants against each other
    and against known values; here both of gradhooks' (dp-accounting's RDP and PLD) against
    the exact ε of the Gaussian mechanism: ``steps`` full-batch steps (``q = 1``) of noise
    ``σ`` compose to one Gaussian mechanism of noise ``σ/√steps``. PLD is tight (within 1%,
    never below), RDP an upper bound (not below, within 35%)."""
    pytest.importorskip("dp_accounting")
    delta = 1e-5
    exact = gaussian_epsilon(delta, sigma / math.sqrt(steps))
    got = {}
    for method in ("pld", "rdp"):
        acc = gradhooks.PrivacyAccountant(method)
        acc.step(noise_multiplier=sigma, sample_rate=1.0, steps=steps)
        got[method] = acc.epsilon(delta)
    assert exact * (1 - 1e-6) <= got["pld"] <= exact * 1.01, (exact, got)
    assert exact <= got["rdp"] <= exact * 1.35, (exact, got)


def test_opacus_accountants_subsampling_amplifies_and_pld_is_tighter():
    """Opacus' ``accountants_test.py`` (``test_rdp_accountant``, ``test_prv_accountant``):
    under Poisson sampling ε grows with the steps, shrinks with the sampling rate, and the
    tighter accountant (PLD here, PRV there) is below RDP; every ε is below the unsampled
    Gaussian mechanism's of the same steps."""
    pytest.importorskip("dp_accounting")
    delta, sigma = 1e-5, 1.2

    def eps(method, q, steps):
        acc = gradhooks.PrivacyAccountant(method)
        acc.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
        return acc.epsilon(delta)

    rdp = [eps("rdp", 0.01, s) for s in (100, 400, 1600)]
    assert rdp == sorted(rdp) and len(set(rdp)) == 3
    assert eps("rdp", 0.005, 400) < rdp[1] < eps("rdp", 0.02, 400)
    pld = eps("pld", 0.01, 400)
    assert pld < rdp[1]
    assert rdp[1] < gaussian_epsilon(delta, sigma / math.sqrt(400))


def test_opacus_make_private_with_epsilon_spends_close_to_the_target():
    """Opacus' ``test_make_private_with_epsilon``: the noise calibrated to a target ε over
    the planned epochs spends at most the target once every planned step is taken, and
    not much less (within 5%: the smallest noise within the budget)."""
    pytest.importorskip("dp_accounting")
    model = seeded(lambda: nn.Linear(4, 2)).double()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4, dtype=D), torch.randint(0, 2, (40,)))
    private = gradhooks.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                     target_epsilon=2.0, delta=1e-5, epochs=2,
                                     expected_batch_size=8, max_grad_norm=1.0, generator=g)  # fmt: skip
    steps = 0
    for x, y in private.batches():
        private.backward(F.cross_entropy(model(x), y, reduction="none"))
        private.step()
        steps += 1
    private.close()
    assert steps == 10  # (2 epochs of 40 / 8 steps)
    assert 0.95 * 2.0 <= private.epsilon <= 2.0


# == curvlinops: test/test_ggn.py, test_ef.py; functorch: per-sample grads with randomness ====


def ggn_by_products(model: nn.Module, x: Tensor, hessian_of_output) -> Tensor:
    """The GGN ``Σ_i J_iᵀ H_i J_i`` as curvlinops' ``GGNLinearOperator`` multiplies by it:
    ``vjp(H · jvp(v))`` of the batch's output for every column ``v`` of the identity."""
    params = {n: p.detach() for n, p in trainable(model).items()}
    sizes = [p.numel() for p in params.values()]

    def out(flat_params):
        ps = dict(zip(params, (t.view_as(p) for t, p in
                               zip(flat_params.split(sizes), params.values()))))  # fmt: skip
        return functional_call(model, ps, (x,))

    theta = torch.cat([p.flatten() for p in params.values()])
    with gradhooks.paused():
        f = out(theta)
        H = hessian_of_output(f.detach())  # [B, C, C]

        def product(v):
            _, jv = torch.func.jvp(out, (theta,), (v,))
            _, pull = torch.func.vjp(out, theta)
            return pull(torch.einsum("bcd,bd->bc", H, jv))[0]

        return vmap(product)(torch.eye(len(theta), dtype=theta.dtype))


def ce_hessian(f: Tensor) -> Tensor:
    p = f.softmax(-1)
    return torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)


def mse_hessian(f: Tensor) -> Tensor:  # (of the sum of squared errors)
    return 2 * torch.eye(f.shape[-1], dtype=f.dtype).expand(f.shape[0], -1, -1)


# (torch's forward-mode AD loads its decompositions by torch.jit.script, which warns)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_curvlinops_ggn_from_per_example_jacobians(net, loss):
    """curvlinops' ``test_ggn.py``: the GGN of a summed loss, ``Σ_i J_iᵀ H_i J_i``, from
    gradhooks' per-example Jacobians and the loss's Hessian in the output, against
    curvlinops' way of multiplying by it (a ``jvp`` then a ``vjp`` of the whole batch)."""
    if net == "mlp":
        model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
        x = seeded(lambda: torch.randn(5, 4), seed=1)
    else:
        model = seeded(lambda: nn.Sequential(nn.Conv2d(1, 2, 2), nn.Sigmoid(), nn.Flatten(),
                                             nn.Linear(8, 3)))  # fmt: skip
        x = seeded(lambda: torch.randn(5, 1, 3, 3), seed=1)
    model, x = model.double(), x.double()
    H = ce_hessian if loss == "cross_entropy" else mse_hessian
    J = gradhooks.jacobians(model, x, flatten=True)
    with torch.no_grad():
        ggn = torch.einsum("bcp,bcd,bdq->pq", J, H(model(x)), J)
    assert_close(ggn, ggn_by_products(model, x, H), f"{net} {loss}: GGN")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_curvlinops_empirical_fisher_from_grad1(reduction):
    """curvlinops' ``EFLinearOperator`` (``test_ef.py``): ``Σ_i ∇ℓ_i ∇ℓ_iᵀ`` for a summed
    loss, ``1/N Σ_i ∇ℓ_i ∇ℓ_iᵀ`` for a mean (its scaling), from ``grad1``, against the
    per-example loop."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    x, y = seeded(lambda: (torch.randn(6, 4, dtype=D), torch.randint(0, 3, (6,))), seed=1)
    want = loop_grad(model, ce_sum, (x,), y)
    hooked(model, x, lambda out, t: F.cross_entropy(out, t, reduction=reduction), y, reduction)
    G = torch.cat([p.grad1.flatten(1) for p in model.parameters()], 1)
    Gw = torch.cat([w.flatten(1) for w in want.values()], 1)
    scale = 1.0 if reduction == "sum" else 1 / len(x)
    assert_close(scale * G.T @ G, scale * Gw.T @ Gw, f"EF ({reduction})")


class DropoutNet(nn.Module):
    """Linear - Tanh - Dropout - Linear: a mask drawn per example in training mode."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 6), nn.Dropout(0.4), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_functorch_per_sample_grads_with_dropout_drawn_per_example():
    """functorch's per-sample-gradient tests with ``vmap(..., randomness="different")``
    (``test/functorch/test_vmap.py``, the random ops; the ``torch.func`` tutorial's dropout):
    in training mode each example draws its own dropout mask. gradhooks' rows are each
    example's gradient under the mask its row of the batch drew: against a loop over the
    examples that multiplies by that same mask."""
    model = seeded(DropoutNet).double().train()
    x, y = seeded(lambda: (torch.randn(5, 4, dtype=D), torch.randint(0, 3, (5,))), seed=1)
    masks = []
    model.drop.register_forward_hook(lambda m, inp, out: masks.append((out / inp[0]).detach()))
    torch.manual_seed(7)
    hooked(model, x, ce_sum, y)
    (mask,) = masks
    kept = (mask - 1 / 0.6).abs() < 1e-12
    assert (kept | (mask == 0)).all() and kept.any() and not kept.all()
    assert not all(torch.equal(mask[0], m) for m in mask[1:])  # (different per example)
    params = list(model.parameters())
    for i in range(len(x)):
        h = torch.tanh(model.fc1(x[i : i + 1])) * mask[i]
        grads = torch.autograd.grad(ce_sum(model.fc2(h), y[i : i + 1]), params)
        for p, g in zip(params, grads, strict=True):
            assert_close(p.grad1[i], g, f"example {i}")


# == every set above: the DP step (Opacus' fast gradient clipping, fastDP's book-keeping) =====

DP_STEP_MODELS = {
    "fc_cosine": (lambda: FCNet("cosine"), lambda g: (torch.rand(4, 1, 14, 14, generator=g),)),
    "dp_lstm_2_layers_bidirectional": (
        lambda: BatchFirst(DPRNN("lstm", 3, 4, layers=2, bidirectional=True), (True, True)),
        lambda g: (torch.randn(4, 5, 3, generator=g), torch.randn(4, 4, 4, generator=g)),
    ),
    "dp_multihead_attention": (
        lambda: BatchFirst(
            DPMultiheadAttention(4, 2, add_bias_kv=True, add_zero_attn=True), (True, True, True)
        ),
        lambda g: tuple(torch.randn(4, s, 4, generator=g) for s in (3, 4, 4)),
    ),  # fmt: skip
    "merged_lora": (
        lambda: MergedLoRA(6, 12, 2, 4, [True, False, True], train_base=True),
        lambda g: (torch.randn(4, 5, 6, generator=g),),
    ),
    "bart_positions_in_a_model": (
        lambda: TokensWithPositions(given=False),
        lambda g: (torch.randint(0, 12, (4, 5), generator=g),),
    ),
    "conv_transpose_groups_dilation": (
        BACKPACK_MODULES["conv_transpose2d_groups_dilation"][0],
        lambda g: (torch.randn(4, 4, 3, 3, generator=g),),
    ),
    "trainable_scale": (
        BACKPACK_MODULES["trainable_scale"][0],
        lambda g: (torch.randn(4, 5, generator=g),),
    ),
    "slicing": (
        CUSTOM_MODULE_MODELS["slicing"],
        lambda g: (torch.randn(4, 2, 5, 8, generator=g),),
    ),
}


def per_example_losses(out: Tensor) -> Tensor:
    """``[batch]``: a loss of each example's output that is not a plain square."""
    flat_out = out.reshape(out.shape[0], -1)
    return (flat_out.sin() * flat_out).sum(1) + 0.3 * flat_out.sum(1)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("name", list(DP_STEP_MODELS))
def test_dp_step_over_the_layers_of_these_suites(name, method):
    """A DP-SGD step without noise (``dp_sgd_step``) through the layers of the suites above
    (nngeometry's Cosine1d, Opacus' DPLSTM and DPMultiheadAttention, dp-transformers' merged
    LoRA and BART positions, BackPACK's transposed convolution and custom modules), for each
    way of clipping: Opacus' ``grad_sample_module_fast_gradient_clipping_test.py`` and
    fastDP's book-keeping. The norms before clipping and the clipped sum against the oracle's
    rows, the clipping norm at their median (half the examples clipped)."""
    factory, inputs = DP_STEP_MODELS[name]
    model = seeded(factory).double()
    x = tuple(as_double(t) for t in inputs(torch.Generator().manual_seed(1)))
    want = vmap_grad(model, lambda out: per_example_losses(out).sum(), x)
    rows = torch.cat([g.reshape(len(g), -1) for g in want.values()], 1)
    norms = rows.norm(dim=1)
    clip = float(norms.median())
    factor = (clip / norms).clamp(max=1.0)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        got = gradhooks.dp_sgd_step(h, per_example_losses(model(*x)), max_norm=clip,
                                    noise_multiplier=0.0, reduction="sum", method=method)  # fmt: skip
    assert_close(got, norms, f"{name} ({method}): norms")
    for n, p in trainable(model).items():
        assert_close(
            p.grad, torch.einsum("b,b...->...", factor, want[n]), f"{name} ({method}): {n}"
        )


# == a backward that starts at a layer's own output ============================================


class FirstOutput(nn.Module):
    """A layer that returns several tensors (RNN: output and state; attention: output and
    weights), the model's output its first, as it is: no operation after the layer."""

    def __init__(self, layer: nn.Module, attention: bool = False):
        super().__init__()
        self.layer, self.attention = layer, attention

    def forward(self, x: Tensor) -> Tensor:
        return (self.layer(x, x, x) if self.attention else self.layer(x))[0]


ENDING_IN_A_LAYER = {
    "rnn": (lambda: FirstOutput(nn.RNN(3, 2, batch_first=True)), (3, 4, 3)),
    "gru": (lambda: FirstOutput(nn.GRU(3, 2, batch_first=True)), (3, 4, 3)),
    "lstm": (lambda: FirstOutput(nn.LSTM(3, 2, batch_first=True)), (3, 4, 3)),
    "attention": (
        lambda: FirstOutput(nn.MultiheadAttention(4, 2, batch_first=True), True),
        (3, 2, 4),
    ),  # fmt: skip
}


def loop_jacobians(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """``{name: [batch, outputs, *p.shape]}`` by one autograd backward per example and output."""
    params = trainable(model)
    rows = []
    for i in range(len(x)):
        out = model(x[i : i + 1]).reshape(-1)
        rows.append([torch.autograd.grad(o, list(params.values()), retain_graph=True) for o in out])
    return {n: torch.stack([torch.stack([r[k] for r in row]) for row in rows])
            for k, n in enumerate(params)}  # fmt: skip


@pytest.mark.parametrize("name", list(ENDING_IN_A_LAYER))
def test_nngeometry_jacobians_of_a_network_ending_in_a_recurrent_or_attention_layer(name):
    """nngeometry's ``Jacobian`` (and curvlinops' ``JacobianLinearOperator``) of a network
    whose output is a recurrent or attention layer's own output: the backward of the
    Jacobians starts at that layer's output. Against a loop of autograd over every example
    and output."""
    factory, shape = ENDING_IN_A_LAYER[name]
    model = seeded(factory).double()
    x = seeded(lambda: torch.randn(*shape, dtype=D), seed=1)
    want = loop_jacobians(model, x)
    got = gradhooks.jacobians(model, x)
    for n in want:
        assert_close(got[n], want[n], f"{name}: {n}")


class ThenIdentity(nn.Module):
    """The wrapped model's output through one more operation that changes nothing."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * 1.0


@pytest.mark.parametrize("name", list(ENDING_IN_A_LAYER))
def test_curvlinops_kfac_of_a_network_ending_in_a_recurrent_or_attention_layer(name):
    """curvlinops' and ASDL's K-FAC of a network whose output is a recurrent or attention
    layer's own output (gradhooks' ``kfac`` runs its backward from the loss's
    output-gradients, rooted at that output): the same factors as with one more operation
    after the layer, and a factor for every weight the layer's rule gives one."""
    factory, shape = ENDING_IN_A_LAYER[name]
    model = seeded(factory).double()
    x = seeded(lambda: torch.randn(*shape, dtype=D), seed=1)
    y = seeded(lambda: torch.randn_like(model(x)), seed=2)
    got = gradhooks.kfac(model, x, y, fisher="empirical", loss="mse", reduction="sum")
    want = gradhooks.kfac(ThenIdentity(model), x, y, fisher="empirical", loss="mse",
                          reduction="sum")  # fmt: skip
    assert want and [f"inner.{n}" for n in got] == list(want), (list(got), list(want))
    for n, f in got.items():
        assert_close(f.A, want[f"inner.{n}"].A, f"{name}: A of {n}")
        assert_close(f.G, want[f"inner.{n}"].G, f"{name}: G of {n}")


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("name", list(ENDING_IN_A_LAYER))
def test_functorch_vjp_of_a_layer_output_under_hooks(name, verify):
    """A backward started at the model's output with a given output-gradient,
    ``out.backward(v)`` (functorch's ``vjp`` tests, BackPACK's and Opacus' tests of one layer
    alone): each example's gradient of ``<out_i, v_i>``, with the run-time check on and off."""
    factory, shape = ENDING_IN_A_LAYER[name]
    model = seeded(factory).double()
    x = seeded(lambda: torch.randn(*shape, dtype=D), seed=1)
    v = seeded(lambda: torch.randn_like(model(x)), seed=2)
    want = vmap_grad(model, lambda out, t: (out * t).sum(), (x,), v)
    with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
        model(x).backward(v)
    for n, p in trainable(model).items():
        assert hasattr(p, "grad1"), f"{name}: {n} has no grad1"
        assert_close(p.grad1, want[n], f"{name}: {n}")


class OutputAndState(nn.Module):
    """An RNN's output and its last state, both returned (the state batch first)."""

    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(3, 2, batch_first=True)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out, state = self.rnn(x)
        state = state[0] if isinstance(state, tuple) else state
        return out, state.transpose(0, 1)


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM], ids=lambda k: k.__name__)
def test_functorch_vjp_of_both_outputs_of_a_recurrent_layer(kind):
    """``torch.autograd.backward([out, state], [v, w])``, a backward of two roots, both a
    recurrent layer's (functorch's ``vjp`` of a function of several outputs): each example's
    gradient of ``<out_i, v_i> + <state_i, w_i>``."""
    model = seeded(lambda: OutputAndState(kind)).double()
    x = seeded(lambda: torch.randn(3, 4, 3, dtype=D), seed=1)
    v, w = seeded(lambda: (torch.randn(3, 4, 2, dtype=D), torch.randn(3, 1, 2, dtype=D)), seed=2)

    def loss(outs, t):
        return (outs[0] * t[:, :8].view(-1, 4, 2)).sum() + (outs[1] * t[:, 8:].view(-1, 1, 2)).sum()

    want = loop_grad(model, loss, (x,), torch.cat([v.flatten(1), w.flatten(1)], 1))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        torch.autograd.backward(list(model(x)), [v, w])
    for n, p in trainable(model).items():
        assert_close(p.grad1, want[n], f"{kind.__name__}: {n}")


class SequenceClassifier(nn.Module):
    """Linear - Tanh - Linear over every position of a sequence, ``[B, T, C]`` logits."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_curvlinops_per_example_gradients_of_a_loss_over_flattened_positions(reduction):
    """curvlinops' tests of models with a sequence dimension flatten the batch and sequence
    dimensions into one before the loss (``CrossEntropyLoss`` on ``[B·T, C]``): a mean over
    ``B·T`` terms. Each example's own loss is then its mean over its ``T`` positions (its
    batch of one), and ``grad1`` its gradient; ``grad1`` reduces to ``.grad``."""
    model = seeded(SequenceClassifier).double()
    x = seeded(lambda: torch.randn(5, 7, 4, dtype=D), seed=1)
    y = seeded(lambda: torch.randint(0, 3, (5, 7)), seed=2)

    def loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction=reduction)

    want = vmap_grad(model, loss, (x,), y)
    hooked(model, x, loss, y, reduction)
    for n, p in trainable(model).items():
        assert_close(p.grad1, want[n], f"{reduction}: {n}")
        assert_close(p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0), p.grad, n)

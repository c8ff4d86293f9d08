"""An eleventh set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd and
:mod:`gradhooks.oracle`). The first ten sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to :mod:`test_peer_suites_tenth`;
this one adds the projects that read per-example gradients to watch or explain training:

- Cockpit (``f-dangel/cockpit``: ``tests/test_quantities/test_norm_test.py``,
  ``test_inner_test.py``, ``test_ortho_test.py``, ``test_mean_gsnr.py``, ``test_tic.py``,
  ``test_grad_hist.py``, ``tests/test_bugs/test_issue5.py``, ``test_issue6.py``): its norm,
  inner-product and orthogonality tests, the mean gradient signal-to-noise ratio and the
  Takeuchi information criterion (diagonal and trace) over five SGD steps of its toy network,
  from gradhooks' norms, squared sums and ``grad1`` asked together or one at a time; its
  one- and two-dimensional histograms of the per-example gradients' entries; a
  ``create_graph=True`` backward of an Adam step and a custom container;
- kronfluence (``pomonam/kronfluence``: ``tests/modules/test_per_sample_gradients.py``,
  ``tests/factors/test_covariances.py``, ``tests/factors/test_lambdas.py``): per-sample
  gradients of its MLP, its MLP with a Linear called three times, its CNNs (in-place ReLUs,
  BatchNorm in eval) under its training losses (summed MSE, summed cross-entropy) and its
  measurement (the margin, formed by writing ``-inf`` into a clone of the logits), over
  batches of 3 whose last is short, in its ``[out, in + 1]`` module-matrix layout; K-FAC
  covariances that do not depend on the batch size, on in-place activations or on
  ``checkpoint_sequential``; the EKFAC eigenvalue corrections (its "lambda matrices"); and a
  padded BERT batch with its attention mask against each sequence unpadded alone;
- ViViT (``f-dangel/vivit``: ``test/extensions/firstorder/batch_grad/test_gram_batch_grad.py``,
  ``test/optim/test_directional_derivatives.py``, ``test/settings.py``): the Gram matrix of the
  per-example gradients, centered and not, whole and per layer, whose spectrum is the
  gradient covariance's; the first- and second-order directional derivatives ``γ[n, d]`` and
  ``λ[n, d]`` along the GGN's leading eigenvectors, from ``grad1`` and the per-example
  Jacobians, on its networks (pooling, sigmoids, a Linear over an extra dimension).

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev
from torch.utils.checkpoint import checkpoint_sequential

import gradhooks
from gradhooks.oracle import loop_grad
from harness import Logits, assert_close, flat_grads, grad1_of, hf, seeded, tiny_bert_config

D = torch.float64


flat = flat_grads


# == Cockpit: tests/test_quantities/*, tests/test_bugs/* ===========================================


def cockpit_toy() -> nn.Sequential:
    """Cockpit's ``load_toy_model``, for its ``ToyData`` of ``[1, 5, 5]`` images, 3 classes."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(25, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)
    ).to(D)


def toy_batch(step: int, n: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.rand(n, 1, 5, 5, generator=g, dtype=D) + 0.1, torch.randint(3, (n,), generator=g)


def diag_hessian(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The mean loss's Hessian diagonal, every parameter flattened in order (Cockpit's
    ``autograd_diag_hessian``)."""
    params = dict(model.named_parameters())

    def loss(*flat_params):
        ps = dict(zip(params, flat_params))
        return F.cross_entropy(functional_call(model, ps, (x,)), y)

    h = hessian(loss, argnums=tuple(range(len(params))))(*params.values())
    return torch.cat([h[i][i].reshape(p.numel(), p.numel()).diagonal() for i, p in
                      enumerate(params.values())])  # fmt: skip


def norm_test(s) -> Tensor:
    return ((s.sq.sum() / s.g.square().sum() - s.n) / (s.n * (s.n - 1))).sqrt()


def inner_test(s) -> Tensor:
    return ((s.proj.square().sum() / s.g.square().sum() ** 2 - s.n) / (s.n * (s.n - 1))).sqrt()


def ortho_test(s) -> Tensor:
    g2 = s.g.square().sum()
    return ((s.sq / g2 - s.proj.square() / g2**2).sum() / (s.n * (s.n - 1))).sqrt()


def mean_gsnr(s, epsilon: float = 1e-5) -> Tensor:
    return (s.g.square() / (s.second - s.g.square() + epsilon)).mean()


def tic_diag(s, epsilon: float = 1e-7) -> Tensor:
    return (s.second / (s.diag_h + epsilon)).sum()


def tic_trace(s, epsilon: float = 1e-7) -> Tensor:
    return s.second.sum() / (s.diag_h.sum() + epsilon)


# name: (the quantity from the statistics, what it reads from gradhooks alone)
COCKPIT = {
    "NormTest": (norm_test, ("norms",)),
    "InnerTest": (inner_test, ("grad1",)),
    "OrthoTest": (ortho_test, ("grad1", "norms")),
    "MeanGSNR": (mean_gsnr, ("sum_grad_sq",)),
    "TICDiag": (tic_diag, ("sum_grad_sq",)),
    "TICTrace": (tic_trace, ("sum_grad_sq",)),
}


def hooked_stats(h: gradhooks.Hooks, model: nn.Module, n: int, diag_h: Tensor):
    """The statistics Cockpit's quantities read, each from the gradhooks quantity that gives
    it where that was asked for: squared norms from ``h.norms()``, the second moment from
    ``h.sum_grad_sq()``, projections on the mean gradient from ``grad1``."""
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    s = SimpleNamespace(n=n, g=g, diag_h=diag_h, sq=None, proj=None, second=None)
    if "norms" in h.quantities:
        s.sq = h.norms().square()
    if "grad1" in h.quantities:
        s.proj = flat(grad1_of(model)) @ g
    if "sum_grad_sq" in h.quantities:
        sums = h.sum_grad_sq()  # (keyed by name, in the order the backward reached them)
        s.second = torch.cat([sums[name].flatten() for name, _ in model.named_parameters()]) / n
    return s


def loop_stats(per_example: Tensor, g: Tensor, n: int, diag_h: Tensor):
    return SimpleNamespace(
        n=n, g=g, diag_h=diag_h, sq=per_example.square().sum(1), proj=per_example @ g,
        second=per_example.square().mean(0),
    )  # fmt: skip


@pytest.mark.parametrize("together", [True, False], ids=["one-run", "independent-runs"])
@pytest.mark.parametrize("name", list(COCKPIT))
def test_cockpit_quantity_over_sgd_steps(name, together):
    """Cockpit's ``test_<quantity>``: its toy network trained by SGD for five steps on batches
    of 5 under the mean cross-entropy; at every step the quantity from gradhooks (all
    quantities asked in one run, or only the one it reads: Cockpit's ``independent_runs``)
    equals the one from the per-example loop."""
    quantity, reads = COCKPIT[name]
    asked = ("grad1", "norms", "sum_grad_sq") if together else reads
    model = seeded(cockpit_toy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, quantities=asked) as h:
        for step in range(5):
            x, y = toy_batch(step)
            opt.zero_grad()
            with h.paused():
                want_grads = flat(loop_grad(model, F.cross_entropy, x, y))
                diag_h = diag_hessian(model, x, y)
            F.cross_entropy(model(x), y).backward()
            got = quantity(hooked_stats(h, model, 5, diag_h))
            g = torch.cat([p.grad.flatten() for p in model.parameters()])
            want = quantity(loop_stats(want_grads, g, 5, diag_h))
            assert torch.isfinite(want), f"{name} step {step}"
            assert_close(got, want, f"{name} at step {step}")
            opt.step()


def histogram_1d(per_example: Tensor, bins: int = 20, lim: float = 0.2) -> numpy.ndarray:
    """Cockpit's ``GradHist1d``: every entry of every per-example gradient, clamped."""
    data = per_example.clamp(-lim, lim).numpy()
    return numpy.histogram(data, bins=bins, range=(-lim, lim))[0]


def histogram_2d(model: nn.Module, grads: dict, bins=(10, 8), lims=(0.2, 1.0)) -> numpy.ndarray:
    """Cockpit's ``GradHist2d``: each per-example gradient entry against its parameter's
    value, clamped to the bin centres at the edges, summed over examples and parameters."""
    total = 0
    for name, p in model.named_parameters():
        data = []
        for t, lim, b in zip((grads[name], p.detach()), lims, bins):
            half = lim / b
            data.append(t.clamp(-lim + half, lim - half))
        for row in data[0]:
            total = total + numpy.histogram2d(
                row.flatten().numpy(), data[1].flatten().numpy(), bins=bins,
                range=[(-lims[0], lims[0]), (-lims[1], lims[1])],
            )[0]  # fmt: skip
    return total


@pytest.mark.parametrize("dims", ["GradHist1d", "GradHist2d"])
def test_cockpit_gradient_histograms(dims):
    """Cockpit's ``test_grad_hist.py``: the histograms of the per-example gradients' entries
    (against the parameters' values, in 2-d) from ``grad1`` are the loop's, bin for bin; the
    gradients are far from every bin edge, so the counts are exact."""
    model = seeded(cockpit_toy)
    x, y = toy_batch(0, n=8)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    got = grad1_of(model)
    if dims == "GradHist1d":
        h_got, h_want = histogram_1d(flat(got)), histogram_1d(flat(want))
    else:
        h_got, h_want = histogram_2d(model, got), histogram_2d(model, want)
    assert h_want.sum() == 8 * sum(p.numel() for p in model.parameters())
    assert (h_got == h_want).all(), f"{dims}: {h_got} != {h_want}"


class CustomContainer(nn.Module):
    """From Cockpit's reproduction of a reported bug: a container that is not an
    ``nn.Sequential``."""

    def __init__(self, d_in: int = 3, d_out: int = 1):
        super().__init__()
        self.linear, self.relu = nn.Linear(d_in, d_out), nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.linear(x))


COCKPIT_BUGS = {
    "issue5-adam-create-graph": lambda: nn.Sequential(nn.Flatten(), nn.Linear(3, 1)),
    "issue6-custom-container": lambda: CustomContainer(),
}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("bug", list(COCKPIT_BUGS))
def test_cockpit_bug_reproductions(bug):
    """Cockpit's ``test_issue5.py`` / ``test_issue6.py``: a mean MSE on a ``[N, 1]`` output,
    backpropagated with ``create_graph=True`` (as Cockpit does for its curvature quantities)
    before an Adam step, and a custom container: ``grad1`` is the loop's at each of two steps,
    and the step that follows is Adam's on ``.grad``."""
    model = seeded(COCKPIT_BUGS[bug]).to(D)
    reference = seeded(COCKPIT_BUGS[bug]).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-1)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.rand(4, 3, generator=g, dtype=D), torch.rand(4, 1, generator=g, dtype=D)
            want = loop_grad(reference, F.mse_loss, x, y)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward(create_graph=True)
            for n, p in model.named_parameters():
                assert_close(p.grad1.detach(), want[n], f"{bug} step {step}: {n}")
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), f"{bug}: {n} after two Adam steps")


# == kronfluence: tests/modules/test_per_sample_gradients.py, tests/factors/* =====================


class RepeatedMLP(nn.Module):
    """kronfluence's ``RepeatedMLP``: ``shared_linear`` called three times in one forward."""

    def __init__(self):
        super().__init__()
        self.linear1, self.shared_linear = nn.Linear(10, 16), nn.Linear(16, 16)
        self.linear2, self.linear3 = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.shared_linear(torch.relu(self.linear1(x)))
        x = self.linear2(torch.relu(self.shared_linear(torch.relu(x))))
        return self.linear3(torch.relu(self.shared_linear(torch.relu(x))))


def kron_conv(inplace: bool = False, bn: bool = False) -> nn.Sequential:
    """kronfluence's ``make_conv_model`` (``conv_inplace``, ``conv_bn``) for ``[3, 16, 16]``."""
    norm = nn.BatchNorm2d if bn else lambda c: nn.Identity()
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(inplace=inplace), norm(4),
        nn.Conv2d(4, 8, 3), nn.ReLU(inplace=inplace), norm(8),
        nn.Flatten(), nn.Linear(1152, 5),
    )  # fmt: skip


def kron_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


class Checkpointed(nn.Module):
    """kronfluence's ``GradientCheckpointRegressionTask``: the model run by
    ``checkpoint_sequential`` in two segments, non-reentrant."""

    def __init__(self, seq: nn.Sequential):
        super().__init__()
        self.seq = seq

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint_sequential(self.seq, 2, x, use_reentrant=False)


def mse_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target, reduction="sum")


def ce_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="sum")


def margin(logits: Tensor, labels: Tensor) -> Tensor:
    """kronfluence's ``ClassificationTask.compute_measurement``: minus the summed margins,
    the other classes' logsumexp taken after writing ``-inf`` into a clone of the logits."""
    rows = torch.arange(logits.shape[0])
    correct = logits[rows, labels]
    others = logits.clone()
    others[rows, labels] = -torch.inf
    return -(correct - others.logsumexp(-1)).sum()


def regression_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g, dtype=D), torch.randint(-5, 5, (n, 1), generator=g).to(D)


def classification_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 16, 16, generator=g, dtype=D), torch.randint(5, (n,), generator=g)


# name: (model factory, data, training loss, measurement)
KRONFLUENCE = {
    "mlp": (kron_mlp, regression_data, mse_sum, mse_sum),
    "repeated_mlp": (RepeatedMLP, regression_data, mse_sum, mse_sum),
    "conv": (kron_conv, classification_data, ce_sum, margin),
    "conv_inplace": (lambda: kron_conv(inplace=True), classification_data, ce_sum, margin),
    "conv_bn": (lambda: kron_conv(bn=True), classification_data, ce_sum, margin),
}


def kron_model(name: str) -> nn.Module:
    model = seeded(KRONFLUENCE[name][0]).to(D)
    if name == "conv_bn":  # (running statistics of their own, as a trained model's)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model.eval()  # (kronfluence's prepare_test)


def module_matrices(model: nn.Module, grads: dict) -> dict[str, Tensor]:
    """kronfluence's ``reshape_parameter_gradient_to_module_matrix``: each Linear's and
    Conv2d's per-example gradient as ``[batch, out, in (· k · k) + 1]``, the bias last."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            w = grads[f"{name}.weight"]
            out[name] = torch.cat([w.flatten(2), grads[f"{name}.bias"][..., None]], -1)
    return out


@pytest.mark.parametrize("loss", ["train-loss", "measurement"])
@pytest.mark.parametrize("name", list(KRONFLUENCE))
def test_kronfluence_per_sample_gradients(name, loss):
    """kronfluence's ``test_for_loop_per_sample_gradient_equivalence`` and
    ``test_mean_gradient_equivalence``: 10 examples in batches of 3 (the last of one), each
    batch's summed training loss or measurement backpropagated in turn: the module matrices
    of ``grad1`` are the per-example loop's, and their sum over every batch is the gradient
    of the whole data set's loss."""
    _, data, train, measurement = KRONFLUENCE[name]
    fn = train if loss == "train-loss" else measurement
    model = kron_model(name)
    x, y = data(10)
    want = module_matrices(model, loop_grad(model, fn, x, y))
    fn(model(x), y).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    rows = []
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for start in range(0, 10, 3):
            model.zero_grad()
            fn(model(x[start : start + 3]), y[start : start + 3]).backward()
            rows.append(module_matrices(model, grad1_of(model)))
    for n, w in want.items():
        got = torch.cat([r[n] for r in rows])
        assert_close(got, w, f"{name} {loss}: {n}")
    for n, w in module_matrices(model, {n: g[None] for n, g in whole.items()}).items():
        assert_close(torch.cat([r[n] for r in rows]).sum(0), w[0], f"{name} {loss}: {n} summed")


def kron_factors(model: nn.Module, name: str, x: Tensor, y: Tensor, fisher: str) -> dict:
    loss = KRONFLUENCE[name][2]
    return gradhooks.kfac(model, x, y, fisher=fisher, loss=loss, reduction="sum")


def combined(parts: list[tuple[int, dict]]) -> dict[str, tuple[Tensor, Tensor]]:
    """Factors of batches put together as kronfluence accumulates its covariances: ``A`` (a
    mean over the examples' positions) weighted by each batch's size, ``G`` (a sum) added."""
    total = sum(n for n, _ in parts)
    return {
        k: (sum(n * f[k].A for n, f in parts) / total, sum(f[k].G for _, f in parts))
        for k in parts[0][1]
    }


@pytest.mark.parametrize("fisher", ["empirical", "exact"])
@pytest.mark.parametrize("name", ["mlp", "repeated_mlp", "conv"])
def test_kronfluence_covariances_batch_size_equivalence(name, fisher):
    """kronfluence's ``test_covariance_matrices_batch_size_equivalence``: the Kronecker
    factors of 12 examples are those of batches of 4 and of 8 put together."""
    model = kron_model(name)
    x, y = KRONFLUENCE[name][1](12, seed=1)
    whole = kron_factors(model, name, x, y, fisher)
    for size in (4, 8):
        parts = [(len(x[s : s + size]), kron_factors(model, name, x[s : s + size], y[s : s + size], fisher))
                 for s in range(0, 12, size)]  # fmt: skip
        for k, (a, g) in combined(parts).items():
            assert_close(a, whole[k].A, f"{name} {fisher} by {size}: {k} A")
            assert_close(g, whole[k].G, f"{name} {fisher} by {size}: {k} G")


VARIANTS = {
    "inplace-relu": ("conv", lambda: kron_conv(inplace=True)),
    "gradient-checkpoint": ("mlp", lambda: Checkpointed(kron_mlp())),
    "gradient-checkpoint-conv": ("conv", lambda: Checkpointed(kron_conv())),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kronfluence_covariances_of_equivalent_models(variant):
    """kronfluence's ``test_covariance_matrices_inplace`` and
    ``test_covariance_matrices_gradient_checkpoint``: the same network with in-place ReLUs,
    or run by ``checkpoint_sequential``, has the plain network's factors and ``grad1``."""
    name, factory = VARIANTS[variant]
    plain, other = kron_model(name), seeded(factory).to(D).eval()
    x, y = KRONFLUENCE[name][1](6, seed=2)
    want, got = (
        kron_factors(plain, name, x, y, "empirical"),
        kron_factors(other, name, x, y, "empirical"),
    )
    assert len(got) == len(want)
    for (k, w), g in zip(want.items(), got.values()):
        assert_close(g.A, w.A, f"{variant}: {k} A")
        assert_close(g.G, w.G, f"{variant}: {k} G")
    loss = KRONFLUENCE[name][2]
    ref = loop_grad(plain, loss, x, y)
    with gradhooks.add_hooks(other, loss_reduction="sum"):
        loss(other(x), y).backward()
    for (n, w), p in zip(ref.items(), other.parameters()):
        assert_close(p.grad1, w, f"{variant}: {n}")


def ekfac_lambda(mats: Tensor, q_a: Tensor, q_g: Tensor) -> Tensor:
    """``Σᵢ (Q_Gᵀ Mᵢ Q_A)²`` over the module matrices ``mats`` ``[batch, out, in]``."""
    return (q_g.T @ mats @ q_a).square().sum(0)


@pytest.mark.parametrize("name", ["mlp", "repeated_mlp", "conv"])
def test_kronfluence_lambda_matrices(name):
    """kronfluence's ``test_lambda_equivalence`` (EKFAC): the eigenvalue corrections
    ``Λ = Σᵢ (Q_Gᵀ Mᵢ Q_A)²``, ``Mᵢ`` example ``i``'s module matrix and ``Q_A``, ``Q_G`` the
    eigenvectors of gradhooks' factors, from ``grad1`` as from the per-example loop."""
    model = kron_model(name)
    _, data, loss, _ = KRONFLUENCE[name]
    x, y = data(8, seed=3)
    factors = kron_factors(model, name, x, y, "empirical")
    want = module_matrices(model, loop_grad(model, loss, x, y))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x), y).backward()
    got = module_matrices(model, grad1_of(model))
    for n, m in want.items():
        f = factors[f"{n}.weight"]
        q_a, q_g = torch.linalg.eigh(f.A)[1], torch.linalg.eigh(f.G)[1]

        assert ekfac_lambda(m, q_a, q_g).shape == m.shape[1:]
        want_lambda = ekfac_lambda(m, q_a, q_g)
        assert_close(ekfac_lambda(got[n], q_a, q_g), want_lambda, f"{name}: {n} lambda")


def test_kronfluence_padded_bert_with_attention_mask():
    """kronfluence's ``test_covariance_matrices_attention_mask`` on a one-layer BERT
    classifier in eval: three sequences of 5, 3 and 7 tokens padded on the right to 7 with
    their attention mask. Each row of ``grad1`` (summed cross-entropy) is the gradient of
    that sequence alone and unpadded, and ``G`` (the padded positions' output-gradients are
    zero) is the mean of the sequences' own; ``A``, a mean over every position the layer
    sees, counts the padded ones, unless ``kfac(mask=...)`` is given the attention mask
    (kronfluence's masked ``A``): then the encoder's layers count the real positions alone,
    as the sequences unpadded give it, and the pooled head its examples."""
    torch.manual_seed(0)
    bert = hf("BertForSequenceClassification")(tiny_bert_config(num_labels=3))
    model = Logits(bert, last=False).to(D).eval()
    lengths, labels = [5, 3, 7], torch.tensor([0, 2, 1])
    ids = torch.randint(1, 20, (3, 7))
    mask = (torch.arange(7) < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask  # (pad token 0)
    alone = []
    for i, t in enumerate(lengths):
        model.zero_grad()
        ce_sum(model(ids[i : i + 1, :t]), labels[i : i + 1]).backward()
        alone.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        ce_sum(model(ids, attention_mask=mask), labels).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, torch.stack([a[n] for a in alone]), f"padded bert: {n}")
    padded = gradhooks.kfac(model, ids, labels, kwargs={"attention_mask": mask}, fisher="empirical")
    each = [gradhooks.kfac(model, ids[i : i + 1, :t], labels[i : i + 1], fisher="empirical")
            for i, t in enumerate(lengths)]  # fmt: skip
    assert padded
    for k, f in padded.items():
        assert_close(f.G, sum(e[k].G for e in each) / 3, f"padded bert: {k} G")
    masked = gradhooks.kfac(model, ids, labels, kwargs={"attention_mask": mask},
                            fisher="empirical", mask=mask)  # fmt: skip
    assert any(".encoder." in k for k in masked) and any(".encoder." not in k for k in masked)
    for k, f in masked.items():
        weights = lengths if ".encoder." in k else [1, 1, 1]  # (positions, or the pooled rows)
        want = sum(w * e[k].A for w, e in zip(weights, each, strict=True)) / sum(weights)
        assert_close(f.A, want, f"padded bert, masked: {k} A")
        assert_close(f.G, padded[k].G, f"padded bert, masked: {k} G")


# == ViViT: test/extensions/firstorder/batch_grad/, test/optim/, test/settings.py ================


def targets(n: int, classes: int):
    return lambda: torch.randint(classes, (n,))


# name: (input, network, loss of a batch of one, reduction, target)
VIVIT = {
    "linear-linear-relu-ce-mean": (
        lambda: torch.rand(3, 7), lambda: nn.Sequential(nn.Linear(7, 6), nn.Linear(6, 5), nn.ReLU()),
        F.cross_entropy, "mean", targets(3, 5),
    ),
    "linear-relu-linear-ce-sum": (
        lambda: torch.rand(3, 7), lambda: nn.Sequential(nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 5)),
        F.cross_entropy, "sum", targets(3, 5),
    ),
    "conv-maxpool-sigmoid-ce-mean": (
        lambda: torch.rand(4, 3, 6, 6),
        lambda: nn.Sequential(
            nn.Conv2d(3, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2), nn.Flatten(),
            nn.Linear(8, 5), nn.Sigmoid(),
        ),
        F.cross_entropy, "mean", targets(4, 5),
    ),
    "sigmoid-mse-mean": (
        lambda: torch.rand(3, 7),
        lambda: nn.Sequential(nn.Linear(7, 6), nn.Sigmoid(), nn.Linear(6, 5), nn.Sigmoid()),
        F.mse_loss, "mean", lambda: torch.rand(3, 5),
    ),
    "one-additional-dim-mse-mean": (
        lambda: torch.rand(3, 4, 5),
        lambda: nn.Sequential(
            nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2), nn.Sigmoid(), nn.Flatten()
        ),
        F.mse_loss, "mean", lambda: torch.rand(3, 8),
    ),
}  # fmt: skip


def vivit_problem(name: str):
    make_x, make_model, loss, reduction, make_y = VIVIT[name]
    torch.manual_seed(0)
    x, model, y = make_x().to(D), make_model().to(D), make_y()
    return model, x, (y.to(D) if y.is_floating_point() else y), loss, reduction


def batch_grad(model, x, y, loss, reduction) -> tuple[dict, dict]:
    """BackPACK's ``BatchGrad`` (``grad1`` scaled by ``1 / batch`` under a mean loss) from
    gradhooks and from the loop."""
    scale = 1 / len(x) if reduction == "mean" else 1.0
    want = {n: scale * g for n, g in loop_grad(model, loss, x, y).items()}
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        (loss(model(x), y) * len(x) * scale).backward()  # (the mean, or the sum)
    return {n: scale * g for n, g in grad1_of(model).items()}, want


def gram(per_example: Tensor, centered: bool) -> Tensor:
    if centered:
        per_example = per_example - per_example.mean(0)
    return per_example @ per_example.T


@pytest.mark.parametrize("centered", [False, True], ids=["GramBatchGrad", "CenteredGramBatchGrad"])
@pytest.mark.parametrize("name", list(VIVIT))
def test_vivit_gram_batch_grad(name, centered):
    """ViViT's ``test_(Centered)GramBatchGrad_get_result`` / ``_spectrum`` (and
    ``layerwise``): the ``[batch, batch]`` Gram matrix of the (centered) per-example
    gradients, whole and per parameter, is the loop's, and its eigenvalues are the leading
    ones of the ``[P, P]`` gradient covariance."""
    model, x, y, loss, reduction = vivit_problem(name)
    got, want = batch_grad(model, x, y, loss, reduction)
    for n in want:
        g, w = got[n].flatten(1), want[n].flatten(1)
        assert_close(gram(g, centered), gram(w, centered), f"{name}: {n} layerwise")
    got_gram, rows = gram(flat(got), centered), flat(want)
    assert_close(got_gram, gram(rows, centered), f"{name}: whole")
    rows = rows - rows.mean(0) if centered else rows
    cov = torch.linalg.eigvalsh(rows.T @ rows)[-len(x) :]
    assert_close(torch.linalg.eigvalsh(got_gram), cov, f"{name}: spectrum")


def per_example_ggn(model, x, y, loss, jac: Tensor) -> Tensor:
    """``Jₙᵀ Hₙ Jₙ`` ``[batch, P, P]``, ``Hₙ`` the Hessian of example ``n``'s own loss with
    respect to its output, ``jac`` the per-example Jacobians ``[batch, outputs, P]``."""
    out, k = model(x).detach(), jac.shape[1]

    def own_loss(o: Tensor, target: Tensor) -> Tensor:
        return loss(o[None], target[None])

    hess = torch.stack([hessian(own_loss)(o, t).reshape(k, k) for o, t in zip(out, y)])
    return torch.einsum("nop,noq,nqr->npr", jac, hess, jac)


def loop_jacobians(model: nn.Module, x: Tensor) -> Tensor:
    params = dict(model.named_parameters())

    def row(i: int) -> Tensor:
        def out(ps):
            return functional_call(model, ps, (x[i : i + 1],))[0].flatten()

        return torch.cat([j.flatten(1) for j in jacrev(out)(params).values()], 1)

    return torch.stack([row(i) for i in range(len(x))])


@pytest.mark.parametrize("name", list(VIVIT))
def test_vivit_directional_derivatives(name):
    """ViViT's ``test_directional_derivatives.py``: along the 3 leading eigenvectors ``e_d``
    of the batch loss's GGN, the first-order derivatives ``γ[n, d] = gₙᵀ e_d`` from ``grad1``
    and the second-order ``λ[n, d] = e_dᵀ GGNₙ e_d`` from gradhooks' per-example Jacobians
    are the loop's (the GGN itself too), ``gₙ`` and ``GGNₙ`` example ``n``'s own."""
    model, x, y, loss, reduction = vivit_problem(name)
    scale = 1 / len(x) if reduction == "mean" else 1.0
    want_ggn_n = per_example_ggn(model, x, y, loss, loop_jacobians(model, x))
    got_ggn_n = per_example_ggn(model, x, y, loss, gradhooks.jacobians(model, x, flatten=True))
    assert_close(got_ggn_n, want_ggn_n, f"{name}: per-example GGN")
    evecs = torch.linalg.eigh(scale * want_ggn_n.sum(0))[1][:, -3:]
    want_grads = flat(loop_grad(model, loss, x, y))
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        (loss(model(x), y) * len(x) * scale).backward()
    assert_close(flat(grad1_of(model)) @ evecs, want_grads @ evecs, f"{name}: gamma")
    got_lambda = torch.einsum("pd,npq,qd->nd", evecs, got_ggn_n, evecs)
    want_lambda = torch.einsum("pd,npq,qd->nd", evecs, want_ggn_n, evecs)
    assert_close(got_lambda, want_lambda, f"{name}: lambda")

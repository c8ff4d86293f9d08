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

import math
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
from harness import Logits, assert_close, hf, seeded, tiny_bert_config

D = torch.float64


def flat(grads) -> Tensor:
    """Per-example gradients ``{name: [batch, *shape]}`` (or their list) as ``[batch, P]``."""
    rows = grads.values() if isinstance(grads, dict) else grads
    return torch.cat([g.flatten(1) for g in rows], 1)


def grad1_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad1 for n, p in model.named_parameters() if p.requires_grad}


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
    """Cockpit's issue 6: a container that is not an ``nn.Sequential``."""

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

"""A ninth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` and
per-example loops). The first eight sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third`, :mod:`test_peer_suites_fourth`,
:mod:`test_peer_suites_fifth`, :mod:`test_peer_suites_sixth`, :mod:`test_peer_suites_seventh`
and :mod:`test_peer_suites_eighth`; this one adds:

- BackPACK (``test/bugfixes_test.py``, ``test/interface_test.py``,
  ``test/test_problems_padding.py``, ``test/test_problems_pooling.py``,
  ``test/adaptive_avg_pool/``): the strided, padded and dilated Conv2d whose output leaves the
  input's last rows unread (its ``bugfixes_test.py``), every quantity, the DP step and bf16
  autocast of it; which parameters each quantity reaches on its two interface networks; its padding and
  pooling problems (``ZeroPad2d`` between unpadded convolutions, max- and average-pooling
  between convolutions, under ``MSELoss`` and ``CrossEntropyLoss``); adaptive average pools
  to every target it lists, also those it refuses;
- Opacus (``multigpu_adaptive_clipping_test.py``, ``schedulers/grad_clip_scheduler_test.py``,
  ``schedulers/noise_scheduler_test.py``, ``randomness_test.py``, ``privacy_engine_test.py``,
  ``validators/instance_norm_test.py``, ``dpdataloader_test.py``,
  ``batch_memory_manager_test.py``, ``accountants_test.py``, ``mixed_precision_test.py``):
  adaptive clipping that clips nothing and adds no noise equal to plain SGD; the clipping
  bound and the noise multiplier changed between steps by exponential, step and lambda
  schedules (each step's noise replayed, the accountant's ε the schedule's), and schedules
  that set a value the constructor refuses, or lower σ below a ``make_private`` run's plan,
  refused; the noise and the batches reproduced by a generator or by the global seed (and
  not without one), the batches the same whatever the noise; a logical batch that drew no
  example (its step is the noise alone); two runs from one seed the same, a run resumed from
  its checkpoint the same as one never stopped; a frozen layer and a ``drop_last`` loader
  against plain SGD; physical batches as the logical batch cut in order; instance norms that
  keep running statistics, in eval; the RDP and PLD accountants and ``noise_multiplier_for``
  against Opacus' own; its mixed-precision models under bf16 autocast in a DP step by every
  method (and its attention models, which attend over the batch, refused).

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
from test_peer_suites import ce, clipped_sum_by_oracle, mse
from test_peer_suites_sixth import check_quantities, trainable
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, assert_grad1, assert_untouched, model_state, seeded

D = torch.float64
METHODS = ["grad1", "ghost", "bookkeeping"]


def quantities_of(method: str) -> tuple[str, ...]:
    return ("grad1",) if method == "grad1" else ("norms",)


def dp_step_matches_oracle(model: nn.Module, x, y, loss, max_norm: float, method: str) -> None:
    """One noiseless ``dp_sgd_step`` (``reduction="sum"``) by ``method`` writes the clipped sum
    of the per-example gradients of ``loss`` (a loss with ``reduction="none"``) that the
    float64 loop gives."""
    want = clipped_sum_by_oracle(
        vmap_grad(model, lambda out, t: loss(out, t).sum(), x, y), max_norm
    )
    with gradhooks.add_hooks(model, quantities=quantities_of(method)) as h:
        gradhooks.dp_sgd_step(
            h, loss(model(x), y), max_norm=max_norm, noise_multiplier=0.0, method=method,
            reduction="sum",
        )  # fmt: skip
    for n, p in trainable(model).items():
        assert_close(p.grad, want[n], f"{method}: {n}")


def summed(out, target=None):
    return out.sum()


# == BackPACK: test/bugfixes_test.py, stride 3 ===================================================

ISSUE_30 = [dict(stride=s, padding=p, dilation=d) for s in (1, 3) for p in (0, 2) for d in (1, 2)]


def issue_30_conv(kw) -> nn.Module:
    return seeded(lambda: nn.Conv2d(4, 6, 3, **kw)).double()


def issue_30_input(batch: int = 4) -> Tensor:
    return seeded(lambda: torch.randn(batch, 4, 6, 6, dtype=D), 1)


@pytest.mark.parametrize("kw", ISSUE_30, ids=str)
def test_backpack_issue_30_conv2d_grad1_norms_and_squared_sums(kw):
    """BackPACK ``test/bugfixes_test.py::test_convolutions_stride_issue_30``: a Conv2d(4, 6, 3)
    on ``[4, 4, 6, 6]`` with stride 1 or 3, padding 0 or 2, dilation 1 or 2 (stride 3 leaves the
    input's last rows unread when it does not divide ``6 + 2·pad - dil·2 - 1``), a summed
    output as the loss: ``grad1`` sums to ``.grad``, and it, its norms and its squared sums
    are the loop's."""
    model = issue_30_conv(kw)
    x = issue_30_input()

    check_quantities(model, x, summed)
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        summed(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1.sum(0), p.grad, f"{n}: grad1 summed vs .grad")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kw", [ISSUE_30[5], ISSUE_30[7]], ids=str)
def test_backpack_issue_30_conv2d_dp_step(kw, method):
    """The same convolutions (BackPACK ``test_convolutions_stride_issue_30``, stride 3) in a
    noiseless DP step by every clipping method, a Linear after them, against the clipped sum
    of the loop's gradients."""
    conv = issue_30_conv(kw)
    width = conv(issue_30_input(1)).numel()
    model = nn.Sequential(conv, nn.Flatten(), seeded(lambda: nn.Linear(width, 3), 2).double())
    x = issue_30_input(5)
    y = torch.tensor([0, 2, 1, 1, 0])
    dp_step_matches_oracle(model, x, y, ce("none"), max_norm=0.3, method=method)


@pytest.mark.parametrize("kw", [ISSUE_30[5], ISSUE_30[7]], ids=str)
def test_backpack_issue_30_conv2d_under_bf16_autocast(kw):
    """The stride-3 convolutions of BackPACK's ``bugfixes_test.py`` under bfloat16 autocast:
    ``grad1`` and the norms close to the float64 loop's (bfloat16's 8 bits: 3e-2 relative)."""
    model = issue_30_conv(kw)
    x = issue_30_input()
    want = vmap_grad(model, summed, x)
    low = copy.deepcopy(model).float()
    with gradhooks.add_hooks(low, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = low(x.float())
        out.float().sum().backward()
        norms = h.param_norms()
    for n, p in low.named_parameters():
        scale = want[n].abs().max()
        torch.testing.assert_close(p.grad1.double() / scale, want[n] / scale, rtol=0, atol=3e-2)
        torch.testing.assert_close(
            norms[n].double(), want[n].flatten(1).norm(dim=1), rtol=3e-2, atol=1e-3
        )


# == BackPACK: test/interface_test.py ===========================================================


def interface_mlp() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 2))).double()


def interface_cnn() -> nn.Module:
    net = seeded(lambda: nn.Sequential(nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(18, 5)))
    return net.double()


INTERFACE = [
    pytest.param(interface_mlp, (3, 5), 2, id="linear-relu-linear"),
    pytest.param(interface_cnn, (2, 3, 4, 4), 5, id="conv-flatten-linear"),
]


@pytest.mark.parametrize("factory, shape, classes", INTERFACE)
def test_backpack_interface_every_weight_and_bias_gets_each_quantity(factory, shape, classes):
    """BackPACK ``test/interface_test.py`` (``test_interface_batch_grad``, ``..._variance``,
    ``..._sum_grad_squared``, ``..._kflr``, ``..._kfac`` and their ``_conv`` twins): after one
    backward of ``CrossEntropyLoss`` (mean) through its two small networks, every weight and
    every bias holds each first-order quantity (``grad1``, norms, squared sums, variance),
    each the loop's, and K-FAC has factors for each weight with its bias."""
    model = factory()
    x = seeded(lambda: torch.randn(*shape, dtype=D), 3)
    y = seeded(lambda: torch.randint(classes, (shape[0],)), 4)
    want = loop_grad(model, ce("sum"), x, y)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms", "sum_grad_sq")) as h:
        F.cross_entropy(model(x), y).backward()
        norms, sums, var = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    names = {n for n, _ in model.named_parameters()}
    assert set(norms) == set(sums) == set(var) == names
    assert_grad1(model, want, "grad1")
    for n in names:
        g = want[n]
        assert_close(norms[n], g.flatten(1).norm(dim=1), f"norms {n}")
        assert_close(sums[n], g.pow(2).sum(0), f"squared sums {n}")
        assert_close(var[n], g.pow(2).mean(0) - g.mean(0) ** 2, f"variance {n}")
    factors = gradhooks.kfac(model, x, y, fisher="empirical")
    weights = {n for n in names if n.endswith("weight")}
    assert set(factors) == weights
    assert all(f.bias for f in factors.values())


# == BackPACK: test/test_problems_padding.py, test/test_problems_pooling.py ======================


def padded_convs() -> nn.Module:
    return nn.Sequential(
        nn.ZeroPad2d((1, 0, 1, 1)), nn.Conv2d(3, 3, (3, 2)),
        nn.ZeroPad2d((1, 0, 1, 1)), nn.Conv2d(3, 3, (3, 2)), nn.Flatten(),
    )  # fmt: skip


def conv_pool_regression(pool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 3, (3, 2), padding=(1, 1)), pool(2), nn.Flatten(), nn.Linear(18, 1)
    )


def conv_pool_classification(pool) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 3, (3, 2), padding=(1, 1)), pool(2), nn.Flatten())


def conv_pool_two_layers(pool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 3, (3, 2), padding=(1, 1)), pool(2),
        nn.Conv2d(3, 3, (3, 2), padding=(1, 1)), pool(2), nn.Flatten(),
    )  # fmt: skip


PROBLEMS = [
    pytest.param(padded_convs, "ce", id="conv+ZeroPad2d-classification-2layer"),
    *[
        pytest.param(
            lambda pool=pool, make=make: make(pool), loss, id=f"conv+{pool.__name__}-{kind}"
        )
        for pool in (nn.MaxPool2d, nn.AvgPool2d)
        for make, loss, kind in [
            (conv_pool_regression, "mse", "regression"),
            (conv_pool_classification, "ce", "classification"),
            (conv_pool_two_layers, "ce", "classification-2layer"),
        ]
    ],
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("factory, lossname", PROBLEMS)
def test_backpack_padding_and_pooling_problems(factory, lossname, reduction):
    """BackPACK ``test/test_problems_padding.py`` and ``test_problems_pooling.py``: its problems
    on ``[5, 3, 4, 5]`` (``ZeroPad2d((1, 0, 1, 1))`` before each of two unpadded (3, 2)
    convolutions; max- or average-pooling by 2 after padded convolutions, then a Linear under
    ``MSELoss`` or the flattened maps as ``CrossEntropyLoss``'s logits over labels < 3), each
    under a mean and a sum loss: ``grad1`` is the loop's, and its mean (sum) is ``.grad``."""
    model = seeded(factory).double()
    x = seeded(lambda: torch.randn(5, 3, 4, 5, dtype=D), 1)
    out_shape = model(x).shape
    y = seeded(
        lambda: torch.randn(out_shape, dtype=D) if lossname == "mse" else torch.randint(3, (5,)),
        2,
    )
    loss = mse if lossname == "mse" else ce
    want = loop_grad(model, loss("sum"), x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        value = loss("sum")(model(x), y)
        (value / 5 if reduction == "mean" else value).backward()
    assert_grad1(model, want, f"{lossname} {reduction}")
    for n, p in model.named_parameters():
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        assert_close(reduced, p.grad, f"{n}: reduced grad1 vs .grad")


# == Opacus: multigpu_adaptive_clipping_test.py ==================================================


class ToyModel(nn.Module):
    """Opacus' ``ToyModel`` of its adaptive-clipping test: Linear(10, 10), ReLU, Linear(10, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


@pytest.mark.parametrize("method", METHODS)
def test_opacus_adaptive_clipping_that_clips_nothing_is_plain_sgd(method):
    """Opacus ``multigpu_adaptive_clipping_test.py::test_adaptive_gradient_correct``: its toy
    model with ``net1``'s weight zeroed, soft labels from ``randn`` under ``CrossEntropyLoss``
    (mean), one step of SGD (lr 1) with adaptive clipping from a bound of 1e8 that clips
    nothing, a target quantile of 1 and no noise: the weights are plain SGD's; every example
    was left unclipped, so the bound stays where it was (the count's noise made negligible)."""
    model = seeded(ToyModel).double()
    with torch.no_grad():
        model.net1.weight.zero_()
    plain = copy.deepcopy(model)
    torch.manual_seed(2)
    x, y = torch.randn(4, 10, dtype=D), torch.randn(4, 5, dtype=D)
    sgd = torch.optim.SGD(plain.parameters(), lr=1.0)
    F.cross_entropy(plain(x), y).backward()
    sgd.step()
    with gradhooks.add_hooks(model, quantities=quantities_of(method)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), h, max_grad_norm=1e8,
            noise_multiplier=0.0, expected_batch_size=4, method=method,
            adaptive_clipping=gradhooks.AdaptiveClipping(target_quantile=1.0, count_noise=1e-9),
        )  # fmt: skip
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        assert opt.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_close(p.detach(), q.detach(), f"{method}: {n}")
    assert math.isclose(opt.max_grad_norm, 1e8, rel_tol=1e-6), opt.max_grad_norm


# == Opacus: schedulers/grad_clip_scheduler_test.py ===============================================

SCHEDULES = {
    "exponential": lambda c0, epoch: c0 * 0.5**epoch,  # ExponentialGradClip(gamma=0.5)
    "step": lambda c0, epoch: c0 * 0.5 ** (epoch // 2),  # StepGradClip(step_size=2, gamma=0.5)
    "lambda": lambda c0, epoch: c0 * (1 + epoch) ** -1.5,  # LambdaGradClip
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_opacus_grad_clip_schedulers_change_the_bound_between_steps(schedule):
    """Opacus ``schedulers/grad_clip_scheduler_test.py`` (``test_exponential_scheduler``,
    ``test_step_scheduler``, ``test_lambda_scheduler``): the optimizer's ``max_grad_norm``
    rewritten after each step by an exponential, a step and a lambda schedule; each of four
    noiseless steps clips by the bound of its own step, against the loop's clipped mean."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))).double()
    x = seeded(lambda: torch.randn(4, 6, 4, dtype=D), 1)
    y = seeded(lambda: torch.randint(3, (4, 6)), 2)
    c0 = 0.4
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), h, max_grad_norm=c0,
            noise_multiplier=0.0, expected_batch_size=6,
        )  # fmt: skip
        for epoch in range(4):
            bound = SCHEDULES[schedule](c0, epoch)
            assert math.isclose(opt.max_grad_norm, bound)
            want = clipped_sum_by_oracle(vmap_grad(model, ce("sum"), x[epoch], y[epoch]), bound)
            opt.backward(F.cross_entropy(model(x[epoch]), y[epoch], reduction="none"))
            expected = {n: want[n] / 6 for n in want}
            # (the gradient the optimizer steps on: checked by the step it takes)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                assert_close((before[n] - p.detach()) / 0.5, expected[n], f"epoch {epoch}: {n}")
            opt.zero_grad()
            opt.max_grad_norm = SCHEDULES[schedule](c0, epoch + 1)


# == Opacus: randomness_test.py ==================================================================


def noised_grads(seed_global: int | None, generator_seed: int | None, sigma: float = 1.0):
    """The gradients of one DP step with noise (``σ``) of a fixed model and batch, the noise drawn
    from a generator seeded with ``generator_seed`` (none given where it is None) after the
    global seed is set to ``seed_global`` (left as it is where None)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), 1)
    y = seeded(lambda: torch.randint(2, (5,)), 2)
    if seed_global is not None:
        torch.manual_seed(seed_global)
    else:
        torch.seed()
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=1.0,
            noise_multiplier=sigma, expected_batch_size=5, generator=generator,
        )  # fmt: skip
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_opacus_optimizer_randomness_no_seed_draws_new_noise():
    """Opacus ``randomness_test.py::OptimizerRandomnessTest::test_no_seed``: without a seed or
    a generator, two runs of the same step draw different noise."""
    assert not torch.equal(noised_grads(None, None), noised_grads(None, None))


def test_opacus_optimizer_randomness_global_seed_reproduces_the_noise():
    """Opacus ``OptimizerRandomnessTest::test_global_seed``: without a generator, the global
    seed reproduces the noise, and another seed changes it."""
    assert torch.equal(noised_grads(7, None), noised_grads(7, None))
    assert not torch.equal(noised_grads(7, None), noised_grads(8, None))


def test_opacus_optimizer_randomness_generator_wins_over_the_global_seed():
    """Opacus ``OptimizerRandomnessTest::test_generator``, ``test_generator_with_global_seed``
    and ``test_generator_seed``: a seeded generator reproduces the noise whatever the global
    seed, and another generator seed changes it."""
    assert torch.equal(noised_grads(1, 11), noised_grads(2, 11))
    assert torch.equal(noised_grads(None, 11), noised_grads(3, 11))
    assert not torch.equal(noised_grads(1, 11), noised_grads(1, 12))


def test_opacus_optimizer_randomness_no_noise_is_deterministic():
    """Opacus ``OptimizerRandomnessTest::test_no_noise``: with ``noise_multiplier=0`` the step
    is the same whatever the seeds, and it is the clipped mean of the loop's gradients."""
    got = noised_grads(None, None, sigma=0.0)
    assert torch.equal(got, noised_grads(5, 9, sigma=0.0))
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), 1)
    y = seeded(lambda: torch.randint(2, (5,)), 2)
    want = clipped_sum_by_oracle(vmap_grad(model, ce("sum"), x, y), 1.0)
    assert_close(got, torch.cat([g.flatten() for g in want.values()]) / 5, "noiseless step")


def poisson_batches(generator_seed: int | None, seed_global: int | None) -> list[list[int]]:
    data = TensorDataset(torch.arange(40))
    if seed_global is not None:
        torch.manual_seed(seed_global)
    else:
        torch.seed()
    g = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    loader = gradhooks.poisson_loader(data, 8, steps=6, generator=g)
    return [b[0].tolist() for b in loader]


def test_opacus_dataloader_randomness_of_poisson_batches():
    """Opacus ``randomness_test.py::DataLoaderRandomnessTest`` (``test_no_seed``,
    ``test_global_seed``, ``test_custom_generator``,
    ``test_custom_generator_with_global_seed``): the Poisson batches differ between unseeded
    runs, are reproduced by the global seed without a generator, and by a generator whatever
    the global seed; each draw holds distinct examples of the dataset."""
    assert poisson_batches(None, None) != poisson_batches(None, None)
    assert poisson_batches(None, 4) == poisson_batches(None, 4)
    assert poisson_batches(3, 1) == poisson_batches(3, 2)
    assert poisson_batches(3, 1) != poisson_batches(4, 1)
    for batch in poisson_batches(3, 1):
        assert len(set(batch)) == len(batch) and all(0 <= i < 40 for i in batch)


# == Opacus: privacy_engine_test.py (empty batches, test_deterministic_run) ======================


@pytest.mark.parametrize("method", METHODS)
def test_opacus_empty_logical_batch_steps_on_the_noise_alone(method):
    """Opacus ``privacy_engine_test.py::PrivacyEngineConvNetEmptyBatchTest``: a logical batch
    that drew no example (a ``[0, 1, 8, 8]`` input through its convolutional network) is run
    and stepped like any other: its gradient is the noise alone, ``σ·C·N(0, I) / expected
    batch size``, drawn from the generator in the order of the parameters; without noise the
    step leaves the weights as they were."""
    model = seeded(
        lambda: nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(4, 3),
        )
    ).double()  # fmt: skip
    empty, labels = torch.zeros(0, 1, 8, 8, dtype=D), torch.zeros(0, dtype=torch.long)
    sigma, bound, ebs = 0.7, 1.5, 4.0
    for noise_multiplier in (0.0, sigma):
        before = [p.detach().clone() for p in model.parameters()]
        with gradhooks.add_hooks(model, quantities=quantities_of(method)) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=1.0), h, max_grad_norm=bound,
                noise_multiplier=noise_multiplier, expected_batch_size=ebs, method=method,
                generator=torch.Generator().manual_seed(5),
            )  # fmt: skip
            norms = opt.backward(F.cross_entropy(model(empty), labels, reduction="none"))
            assert norms.shape == (0,)
            assert opt.step()
        replay = torch.Generator().manual_seed(5)
        for p, b in zip(model.parameters(), before):
            z = torch.normal(torch.zeros_like(b), noise_multiplier * bound, generator=replay)
            assert_close(p.grad, z / ebs, f"{method} σ={noise_multiplier}: grad")
            assert_close(p.detach(), b - z / ebs, f"{method} σ={noise_multiplier}: weights")


def deterministic_run(seed: int) -> list[Tensor]:
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))).double()
    data = TensorDataset(
        seeded(lambda: torch.randn(32, 3, dtype=D), 1), seeded(lambda: torch.randint(2, (32,)), 2)
    )
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.2), data, delta=1e-5,
        max_grad_norm=1.0, noise_multiplier=1.1, steps=3, expected_batch_size=8,
        max_physical_batch_size=4, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    torch.seed()  # (the global seed plays no part)
    for xb, yb in private.batches():
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        private.step()
    private.close()
    return [p.detach().clone() for p in model.parameters()]


def test_opacus_deterministic_run_from_one_seed():
    """Opacus ``privacy_engine_test.py::test_deterministic_run``: two private trainings from
    the same seed (batches and noise drawn from it) end with the same weights; another seed
    gives other weights."""
    first, again, other = deterministic_run(3), deterministic_run(3), deterministic_run(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


# == Opacus: validators/instance_norm_test.py ====================================================

INSTANCE_NORMS = [
    pytest.param(nn.InstanceNorm1d, (4, 3, 7), id="1d"),
    pytest.param(nn.InstanceNorm2d, (4, 3, 5, 6), id="2d"),
    pytest.param(nn.InstanceNorm3d, (4, 3, 3, 4, 5), id="3d"),
]


@pytest.mark.parametrize("layer, shape", INSTANCE_NORMS)
def test_opacus_instance_norm_with_running_statistics_in_eval(layer, shape):
    """Opacus ``validators/instance_norm_test.py`` (an instance norm that tracks running
    statistics, which its validator lets through): after some training forwards, in eval the
    layer normalizes by its running statistics, and ``grad1`` of its affine parameters and of
    a Conv before it, their norms and squared sums, are the loop's."""
    dims = len(shape) - 2
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    model = seeded(
        lambda: nn.Sequential(conv(3, 3, 1), layer(3, affine=True, track_running_stats=True))
    ).double()
    with torch.no_grad():
        for k in range(3):  # (training forwards: each example's statistics into the running)
            model(seeded(lambda: torch.randn(*shape, dtype=D), 10 + k))
        model[1].running_mean.add_(0.5)
        model[1].running_var.mul_(3.0)
    model.eval()
    weight = seeded(lambda: torch.randn(shape[1:], dtype=D), 5)
    x = seeded(lambda: torch.randn(*shape, dtype=D), 6)
    check_quantities(model, x, lambda out, target=None: (out * weight).sum())


# == Opacus: privacy_engine_test.py (test_checkpoints, the frozen network), dpdataloader_test.py ==


def private_run(seed: int, data, frozen: bool = False, **kw):
    """A model (Linear-ReLU-Linear, the first frozen where ``frozen``), an SGD with momentum and
    ``make_private`` over ``data``, all seeded by ``seed``."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)), seed)
    model = model.double()
    if frozen:
        model[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    kw = {"noise_multiplier": 1.1, "max_grad_norm": 0.5, **kw}
    private = gradhooks.make_private(
        model, torch.optim.SGD(trained, lr=0.2, momentum=0.9), data, delta=1e-5, steps=4,
        expected_batch_size=8, generator=torch.Generator().manual_seed(seed), **kw,
    )  # fmt: skip
    return model, private


def train(model, private, until: int | None = None, inside: bool = False):
    """Run ``private``'s batches; with ``until``, return its checkpoint once ``until`` logical
    batches are stepped (with ``inside``, at the first physical batch of the next one)."""
    stepped = 0
    for xb, yb in private.batches():
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        stepped += bool(private.step())
        if until is not None and stepped == until and (not inside or private.optimizer.examples):
            return copy.deepcopy(private.state_dict())
    return None


CHECKPOINTED = [
    pytest.param({}, False, id="plain"),
    pytest.param({"max_physical_batch_size": 3}, True, id="inside-a-logical-batch"),
    pytest.param(
        {"adaptive_clipping": gradhooks.AdaptiveClipping(count_noise=2.0)}, False, id="adaptive"
    ),
    pytest.param({"clipping_groups": "layer"}, False, id="per-layer"),
]


@pytest.mark.parametrize("settings, inside", CHECKPOINTED)
def test_opacus_checkpoints_resume_the_same_run(settings, inside):
    """Opacus ``privacy_engine_test.py::test_checkpoints``: a private run stopped after two
    of its four steps, its checkpoint loaded into a new model, optimizer and engine seeded
    otherwise, and run to the end, ends with the weights, the ε and the clipping bound of the
    run that was never stopped: plain, taken inside a logical batch of physical batches, with
    adaptive clipping, with per-layer clipping (momentum throughout)."""
    data = TensorDataset(
        seeded(lambda: torch.randn(40, 3, dtype=D), 1), seeded(lambda: torch.randint(2, (40,)), 2)
    )
    whole, whole_run = private_run(0, data, **settings)
    train(whole, whole_run)
    first, first_run = private_run(0, data, **settings)
    saved = train(first, first_run, until=2, inside=inside)
    first_run.close()
    assert saved is not None
    resumed, resumed_run = private_run(9, data, **settings)
    resumed_run.load_state_dict(saved)
    train(resumed, resumed_run)
    for (n, p), q in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    assert resumed_run.epsilon == whole_run.epsilon and resumed_run.steps_taken == 4
    assert resumed_run.max_grad_norm == whole_run.max_grad_norm


def test_opacus_frozen_network_compared_to_vanilla_and_drop_last_ignored():
    """Opacus ``privacy_engine_test.py::PrivacyEngineConvNetFrozenTest`` (``test_compare_to_
    vanilla`` with the first layer frozen) and ``dpdataloader_test.py::test_drop_last_true``:
    ``make_private`` given a ``DataLoader`` with ``drop_last=True`` keeps Poisson batches of
    every size; without noise and with a bound no gradient reaches, each step is plain SGD on
    the batch's summed loss over the expected batch size, the frozen layer untouched and
    without a gradient."""
    data = TensorDataset(
        seeded(lambda: torch.randn(10, 3, dtype=D), 1), seeded(lambda: torch.randint(2, (10,)), 2)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, drop_last=True)
    model, private = private_run(0, loader, frozen=True, noise_multiplier=0.0, max_grad_norm=1e6)
    plain = copy.deepcopy(model)
    sgd = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    sizes = []
    for xb, yb in private.batches():
        sizes.append(len(xb))
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        assert private.step()
        sgd.zero_grad()
        (F.cross_entropy(plain(xb), yb, reduction="sum") / 8).backward()
        sgd.step()
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            assert_close(p.detach(), q.detach(), f"step {len(sizes)}: {n}")
    assert model[0].weight.grad is None and len(set(sizes)) > 1
    private.close()


# == Opacus: accountants_test.py (the accountants against Opacus' own) ===========================


@pytest.fixture
def opacus_accountants():
    accountants = pytest.importorskip("opacus.accountants")
    return accountants


@pytest.mark.parametrize("method, theirs", [("rdp", "RDPAccountant"), ("pld", "PRVAccountant")])
def test_opacus_accountants_epsilon_of_its_long_run(opacus_accountants, method, theirs):
    """Opacus ``accountants_test.py::test_rdp_accountant`` and ``test_prv_accountant``: σ = 1.5,
    q = 0.04, ``int(90 / 0.04)`` steps, δ = 1e-5. gradhooks' RDP accountant against Opacus' RDP
    (the same bound: equal to 1e-4 relative, gradhooks' the larger or equal: it bounds the
    fractional orders' series term by term), its PLD accountant against Opacus' PRV accountant
    (two numerical accountants of the same mechanism, each to about 0.01 in ε), both below
    the RDP bound."""
    steps = int(90 / 0.04)
    ours = gradhooks.PrivacyAccountant(method)
    ours.step(noise_multiplier=1.5, sample_rate=0.04, steps=steps)
    other = getattr(opacus_accountants, theirs)()
    other.history = [(1.5, 0.04, steps)]
    got, want = ours.epsilon(1e-5), other.get_epsilon(delta=1e-5)
    if method == "rdp":
        assert want <= got <= want * (1 + 1e-4), (got, want)
    else:
        assert abs(got - want) < 0.02, (got, want)
        rdp = opacus_accountants.RDPAccountant()
        rdp.history = [(1.5, 0.04, steps)]
        assert got < rdp.get_epsilon(delta=1e-5)


@pytest.mark.parametrize(
    "epsilon, steps, sample_rate, delta", [(8.0, 2000, 0.04, 1e-5), (5.0, 300, 0.1, 1e-5)]
)
def test_opacus_noise_multiplier_for_a_target_does_not_overshoot(
    opacus_accountants, epsilon, steps, sample_rate, delta
):
    """Opacus ``accountants_test.py::test_get_noise_multiplier_rdp_steps`` and
    ``test_get_noise_multiplier_overshoot``: the σ found for a
    target ε spends at most that ε by gradhooks' accountant and by Opacus' (no overshoot), is
    within 0.01 of the σ Opacus' ``get_noise_multiplier`` finds, and a σ 1e-3 smaller would
    overshoot (gradhooks searches to 1e-4 in σ)."""
    utils = pytest.importorskip("opacus.accountants.utils")
    sigma = gradhooks.noise_multiplier_for(epsilon, delta, sample_rate, steps)

    def spent(s: float) -> float:
        accountant = gradhooks.PrivacyAccountant("rdp")
        accountant.step(noise_multiplier=s, sample_rate=sample_rate, steps=steps)
        return accountant.epsilon(delta)

    theirs = opacus_accountants.RDPAccountant()
    theirs.history = [(sigma, sample_rate, steps)]
    assert spent(sigma) <= epsilon and theirs.get_epsilon(delta=delta) <= epsilon
    assert spent(sigma - 1e-3) > epsilon
    want = utils.get_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps
    )
    assert abs(sigma - want) < 0.01, (sigma, want)


# == Opacus: mixed_precision_test.py, mixed_precision_utils.py ===================================


class LinearNormsModel(nn.Module):
    """Opacus' ``SimpleLinearModel``: Linear, LayerNorm, a GroupNorm on ``[batch, C, 1]``, an
    RMSNorm between four Linears."""

    def __init__(self, inputs=4, hidden=16, outputs=4) -> None:
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(inputs, hidden), nn.LayerNorm(hidden)
        self.fc2, self.gn = nn.Linear(hidden, hidden), nn.GroupNorm(4, hidden)
        self.fc3, self.rms_norm = nn.Linear(hidden, hidden), nn.RMSNorm(hidden)
        self.fc4 = nn.Linear(hidden, outputs)

    def forward(self, x):
        x = F.relu(self.ln1(self.fc1(x)))
        x = F.relu(self.gn(self.fc2(x).unsqueeze(-1)).squeeze(-1))
        return self.fc4(F.relu(self.rms_norm(self.fc3(x))))


class ConvInstanceModel(nn.Module):
    """Opacus' ``Conv1DModel`` / ``Conv2DModel`` / ``Conv3DModel``: a padded convolution, an
    instance norm without parameters, a global average pool, a Linear."""

    def __init__(self, dims: int, hidden=16, outputs=4) -> None:
        super().__init__()
        self.dims = dims
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](3, hidden, 3, padding=1)
        self.norm = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1](hidden)
        self.fc = nn.Linear(hidden, outputs)

    def forward(self, x):
        x = F.relu(self.norm(self.conv(x)))
        return self.fc(x.mean(tuple(range(2, 2 + self.dims))))


class EmbeddingsModel(nn.Module):
    """Opacus' ``EmbeddingModel`` (an Embedding, a LayerNorm, the mean over the tokens) and
    ``EmbeddingBagModel`` (``EmbeddingBag(mode="mean")`` over the flattened tokens cut by
    ``offsets``, a LayerNorm), each then a ReLU and a Linear."""

    def __init__(self, bag: bool, vocab=100, dim=16, outputs=4) -> None:
        super().__init__()
        self.bag = bag
        self.embedding = (
            nn.EmbeddingBag(vocab, dim, mode="mean") if bag else nn.Embedding(vocab, dim)
        )
        self.layer_norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, outputs)

    def forward(self, x):
        if self.bag:
            offsets = torch.arange(0, x.numel(), x.shape[1], device=x.device)
            x = self.layer_norm(self.embedding(x.reshape(-1), offsets))
        else:
            x = self.layer_norm(self.embedding(x)).mean(1)
        return self.fc(F.relu(x))


class RecurrentModel(nn.Module):
    """Opacus' ``RNNModel``: its ``DPLSTM``, ``DPGRU`` and ``DPRNN`` (batch-first) with
    LayerNorms between them, the last step to a Linear."""

    def __init__(self, inputs=4, hidden=16, outputs=4) -> None:
        super().__init__()
        layers = pytest.importorskip("opacus.layers")
        self.lstm, self.ln1 = layers.DPLSTM(inputs, hidden, batch_first=True), nn.LayerNorm(hidden)
        self.gru, self.ln2 = layers.DPGRU(hidden, hidden, batch_first=True), nn.LayerNorm(hidden)
        self.rnn = layers.DPRNN(hidden, hidden, batch_first=True, nonlinearity="tanh")
        self.fc = nn.Linear(hidden, outputs)

    def forward(self, x):
        x = self.ln1(self.lstm(x)[0])
        x = self.ln2(self.gru(x)[0])
        return self.fc(self.rnn(x)[0][:, -1])


def tokens(*shape: int) -> Tensor:
    return seeded(lambda: torch.randint(100, shape), 1)


PRECISION_MODELS = [
    pytest.param(LinearNormsModel, lambda: torch.randn(3, 4), id="linear"),
    pytest.param(lambda: ConvInstanceModel(1), lambda: torch.randn(3, 3, 12), id="conv1d"),
    pytest.param(lambda: ConvInstanceModel(2), lambda: torch.randn(3, 3, 6, 6), id="conv2d"),
    pytest.param(lambda: ConvInstanceModel(3), lambda: torch.randn(3, 3, 4, 4, 4), id="conv3d"),
    pytest.param(lambda: EmbeddingsModel(False), lambda: tokens(3, 10), id="embedding"),
    pytest.param(lambda: EmbeddingsModel(True), lambda: tokens(3, 10), id="embedding_bag"),
    pytest.param(RecurrentModel, lambda: torch.randn(3, 3, 4), id="rnn"),
]


class Autocast(nn.Module):
    """``model``'s forward under CPU bfloat16 autocast, its output in float32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(x)
        assert out.dtype == torch.bfloat16
        return out.float()


def error_of(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The largest ``|got - want|`` over the parameters, relative to ``want``'s largest entry."""
    scale = max(w.abs().max() for w in want.values())
    return max(((got[n].double() - w).abs().max() / scale).item() for n, w in want.items())


@pytest.mark.parametrize("factory, inputs", PRECISION_MODELS)
def test_opacus_mixed_precision_models_dp_step_under_bf16_autocast(factory, inputs):
    """Opacus ``mixed_precision_test.py`` (``test_linear_model_precision``,
    ``test_conv{1,2,3}d_model_precision``, ``test_embedding_model_precision``,
    ``test_embedding_bag_model_precision``, ``test_rnn_model_precision``) on its models of
    ``mixed_precision_utils.py``: a float32 model's forward under bfloat16 autocast (outputs in
    bfloat16), a noiseless DP step by every clipping method (every example clipped). The
    parameters and their gradients stay float32, and the gradient is as close to the float64
    loop's clipped sum as the same clipped sum of a per-example loop under the same autocast
    (within twice that loop's error and 1e-3 of the largest entry): bfloat16's own rounding,
    which its instance norms amplify (the loop itself is 3e-2 off for the 1-d and 2-d
    convolutions, 0.19 for the 3-d), and no more."""
    model = seeded(factory)
    x = seeded(inputs, 2)
    y = seeded(lambda: torch.randint(4, (3,)), 3)
    wide = x.double() if x.is_floating_point() else x
    want = clipped_sum_by_oracle(loop_grad(copy.deepcopy(model).double(), ce("sum"), wide, y), 0.05)
    low = loop_grad(Autocast(copy.deepcopy(model)), ce("sum"), x, y)
    allowed = (
        2
        * error_of(
            clipped_sum_by_oracle({n[len("model.") :]: g.double() for n, g in low.items()}, 0.05),
            want,
        )
        + 1e-3
    )
    for method in METHODS:
        hooked = copy.deepcopy(model)
        with gradhooks.add_hooks(hooked, quantities=quantities_of(method)) as h:
            out = Autocast(hooked)(x)
            gradhooks.dp_sgd_step(
                h, F.cross_entropy(out, y, reduction="none"), max_norm=0.05,
                noise_multiplier=0.0, method=method, reduction="sum",
            )  # fmt: skip
        for n, p in hooked.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32, n
        got = {n: p.grad for n, p in hooked.named_parameters()}
        assert error_of(got, want) <= allowed, (method, error_of(got, want), allowed)


class TimeMajorAttentionModel(nn.Module):
    """Opacus' ``AttentionModel`` and ``ComplexModel`` (``mixed_precision_utils.py``): a
    time-major attention (``batch_first=False``) given batch-first ``[batch, seq, hidden]``
    activations, so that it attends over the batch; ``batch_first=True`` is the model meant."""

    def __init__(self, complex_: bool, dp_layers: bool, batch_first: bool = False) -> None:
        super().__init__()
        hidden = 16
        self.complex, self.fc_in = complex_, nn.Linear(4, hidden)
        if dp_layers:
            layers = pytest.importorskip("opacus.layers")
            self.attention = layers.DPMultiheadAttention(hidden, 4, batch_first=batch_first)
        else:
            self.attention = nn.MultiheadAttention(hidden, 4, batch_first=batch_first)
        if complex_:
            self.conv1d = nn.Conv1d(hidden, hidden, 3, padding=1)
            self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.fc_out = nn.Linear(hidden, 4)

    def forward(self, x):
        x = self.fc_in(x)
        if self.complex:
            x = x + self.conv1d(x.transpose(1, 2)).transpose(1, 2)
            x = x + self.lstm(x)[0]
            x = x + self.attention(x, x, x)[0]
        else:
            x = self.attention(x, x, x)[0]
        return self.fc_out(x.mean(1))


@pytest.mark.parametrize("dp_layers", [False, True], ids=["torch", "opacus-layers"])
@pytest.mark.parametrize("complex_", [False, True], ids=["attention", "complex"])
def test_opacus_attention_models_that_attend_over_the_batch_are_refused(complex_, dp_layers):
    """Opacus ``mixed_precision_test.py::test_attention_model_precision`` and
    ``test_complex_model_precision``: its ``AttentionModel`` and ``ComplexModel`` give a
    time-major attention (``nn.MultiheadAttention`` or its ``DPMultiheadAttention``) batch-first
    activations, so each example's output depends on the others' and no example has a
    gradient of its own (Opacus computes numbers for them all the same). gradhooks refuses it
    (``BatchNotFoundError`` for torch's layer, ``MixedExamplesError`` where the attention is
    made of Linears and ``bmm``), for ``grad1``, the norms and every DP method, and leaves the
    model untouched; with ``batch_first=True`` it is the float64 loop's."""
    model = seeded(lambda: TimeMajorAttentionModel(complex_, dp_layers)).double()
    x = seeded(lambda: torch.randn(3, 4, 4, dtype=D), 1)
    y = seeded(lambda: torch.randint(4, (3,)), 2)
    before = model_state(model)
    for method in METHODS:
        with gradhooks.add_hooks(model, quantities=quantities_of(method)) as h:
            with pytest.raises((gradhooks.BatchNotFoundError, gradhooks.MixedExamplesError)):
                gradhooks.dp_sgd_step(
                    h, F.cross_entropy(model(x), y, reduction="none"), max_norm=1.0,
                    noise_multiplier=0.0, method=method,
                )  # fmt: skip
        assert_untouched(model, before)
    fixed = seeded(lambda: TimeMajorAttentionModel(complex_, dp_layers, batch_first=True)).double()
    want = loop_grad(fixed, ce("sum"), x, y)
    with gradhooks.add_hooks(fixed, loss_reduction="sum"):
        F.cross_entropy(fixed(x), y, reduction="sum").backward()
    assert_grad1(fixed, want, "batch_first=True")


# == BackPACK: test/adaptive_avg_pool/settings_adaptive_avg_pool_nd.py ===========================

ADAPTIVE_POOLS = [
    (1, 2, (5, 8)),
    (1, 2, (8, 7)),
    (2, (4, 3), (4, 8, 9)),
    (2, 2, (4, 8, 10)),
    (2, 2, (4, 8, 9)),
    (2, (5, 2), (4, 12, 10)),
    (3, (None, 2, None), (4, 7, 10, 5)),
]


@pytest.mark.parametrize("dims, target, shape", ADAPTIVE_POOLS, ids=str)
def test_backpack_adaptive_avg_pool_settings(dims, target, shape):
    """BackPACK ``test/adaptive_avg_pool/settings_adaptive_avg_pool_nd.py``: ``AdaptiveAvgPool
    {1,2,3}d`` to its target sizes (``None`` keeping a dimension) over its input shapes
    (64 channels made 4); BackPACK takes only those a plain average pool can replace (the
    size a multiple of the target) and refuses the others. The pool has no parameters, so
    gradhooks takes every one: a 1x1 convolution before it and a Linear after it, ``grad1``,
    norms and squared sums against the loop."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    pool = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[dims - 1]
    x = seeded(lambda: torch.randn(3, *shape, dtype=D), 1)
    front = nn.Sequential(conv(shape[0], 3, 1), pool(target), nn.Flatten())
    width = front(x[:1].float()).shape[1]
    model = seeded(lambda: nn.Sequential(*front, nn.Linear(width, 2))).double()
    check_quantities(model, x)


# == Opacus: schedulers/noise_scheduler_test.py, randomness_test.py (data seed) ===================

NOISE_SCHEDULES = {
    "exponential": lambda s0, epoch: s0 * 0.9**epoch,  # ExponentialNoise(gamma=0.9)
    "step": lambda s0, epoch: s0 * 0.5 ** (epoch // 2),  # StepNoise(step_size=2, gamma=0.5)
    "lambda": lambda s0, epoch: s0 / (1 + epoch),  # LambdaNoise
}


@pytest.mark.parametrize("schedule", sorted(NOISE_SCHEDULES))
def test_opacus_noise_schedulers_change_sigma_and_the_accounting(schedule):
    """Opacus ``schedulers/noise_scheduler_test.py`` (``test_exponential_scheduler``,
    ``test_step_scheduler``, ``test_lambda_scheduler``): the optimizer's ``noise_multiplier``
    rewritten after each step by an exponential, a step and a lambda schedule. Each of four
    steps (on empty batches: the gradient is the noise alone) draws noise of the step's own
    σ·C, the generator's numbers replayed, and the accountant records each step's σ, so its ε
    is that of the schedule's history."""
    model = seeded(lambda: nn.Linear(6, 5)).double()
    s0, bound, ebs = 1.2, 0.8, 3.0
    accountant = gradhooks.PrivacyAccountant()
    replay = torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), h, max_grad_norm=bound,
            noise_multiplier=s0, expected_batch_size=ebs, sample_rate=0.1,
            accountant=accountant, generator=torch.Generator().manual_seed(4),
        )  # fmt: skip
        for epoch in range(4):
            sigma = NOISE_SCHEDULES[schedule](s0, epoch)
            assert math.isclose(opt.noise_multiplier, sigma)
            opt.backward(model(torch.zeros(0, 6, dtype=D)).pow(2).sum(1))
            opt.step()
            for n, p in model.named_parameters():
                z = torch.normal(torch.zeros_like(p), sigma * bound, generator=replay)
                assert_close(p.grad, z / ebs, f"epoch {epoch}: {n}")
            opt.zero_grad()
            opt.noise_multiplier = NOISE_SCHEDULES[schedule](s0, epoch + 1)
    same = gradhooks.PrivacyAccountant()
    for epoch in range(4):
        same.step(noise_multiplier=NOISE_SCHEDULES[schedule](s0, epoch), sample_rate=0.1)
    assert accountant.steps == 4
    assert accountant.epsilon(1e-5) == same.epsilon(1e-5)


def drawn_batches(seed: int, noise_multiplier: float) -> tuple[list[list[float]], list[Tensor]]:
    """The batches a seeded private run draws, and its final weights."""
    data = TensorDataset(torch.arange(30, dtype=D)[:, None], torch.zeros(30, dtype=torch.long))
    model = seeded(lambda: nn.Linear(1, 2)).double()
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-5,
        max_grad_norm=1.0, noise_multiplier=noise_multiplier, steps=5, expected_batch_size=6,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    batches = []
    for xb, yb in private.batches():
        batches.append(xb[:, 0].tolist())
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        private.step()
    private.close()
    return batches, [p.detach().clone() for p in model.parameters()]


def test_opacus_data_seed_consistency_whatever_the_noise():
    """Opacus ``randomness_test.py::PrivacyEngineSecureModeTest`` (``test_dl_seed_with_noise``,
    ``test_dl_seed_no_noise``, ``test_data_seed_consistency``): the batches a seeded private
    run draws are the same whatever its noise (σ = 1, 0.5 or none: the noise has a stream of
    its own), and differ for another seed; with noise the weights differ from the noiseless
    run's."""
    batches, noisy = drawn_batches(1, 1.0)
    assert drawn_batches(1, 0.5)[0] == batches
    quiet_batches, quiet = drawn_batches(1, 0.0)
    assert quiet_batches == batches
    assert drawn_batches(2, 1.0)[0] != batches
    assert not all(torch.equal(a, b) for a, b in zip(noisy, quiet))


BAD_SETTINGS = [
    ("noise_multiplier", float("nan"), gradhooks.ConfigurationError),
    ("noise_multiplier", -0.5, gradhooks.ConfigurationError),
    ("noise_multiplier", float("inf"), gradhooks.ConfigurationError),
    ("noise_multiplier", None, gradhooks.ConfigurationTypeError),
    ("noise_multiplier", "1.0", gradhooks.ConfigurationTypeError),
    ("max_grad_norm", -1.0, gradhooks.ConfigurationError),
    ("max_grad_norm", float("nan"), gradhooks.ConfigurationError),
    ("expected_batch_size", 0.0, gradhooks.ConfigurationError),
    ("expected_batch_size", None, gradhooks.ConfigurationTypeError),
]


@pytest.mark.parametrize("when", ["before-backward", "before-step"])
@pytest.mark.parametrize("name, value, error", BAD_SETTINGS, ids=str)
def test_opacus_schedulers_that_set_a_bad_value_are_refused(name, value, error, when):
    """Opacus' schedulers (``LambdaNoise``, ``LambdaGradClip``, ``noise_scheduler_test.py``,
    ``grad_clip_scheduler_test.py``) write whatever their function returns into the
    optimizer's ``noise_multiplier`` or ``max_grad_norm``. A value the constructor would have
    refused (a NaN or negative noise multiplier, which drew no noise at all; an infinite one;
    a bound <= 0 or NaN; no expected batch size), written between steps, is refused by the
    next ``backward`` or ``step`` with a typed error, before the model, its gradients or the
    accountant change; the value put back, the step is taken."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), 1)
    y = seeded(lambda: torch.randint(2, (5,)), 2)
    accountant = gradhooks.PrivacyAccountant()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=1.0,
            noise_multiplier=1.0, expected_batch_size=5, sample_rate=0.1, accountant=accountant,
        )  # fmt: skip
        good = getattr(opt, name)
        if when == "before-step":
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        before = model_state(model)
        setattr(opt, name, value)
        with pytest.raises(error):
            if when == "before-backward":
                opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
        assert_untouched(model, before)
        assert accountant.steps == 0
        setattr(opt, name, good)
        if when == "before-backward":
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        assert opt.step()
    assert accountant.steps == 1
    assert not all(torch.equal(p, before["params"][n]) for n, p in model.named_parameters())


def test_make_private_noise_schedule_below_the_plan_is_refused():
    """Opacus' noise schedulers (``ExponentialNoise``, ``noise_scheduler_test.py``) given the
    optimizer of a run made for a target ε (``make_private(target_epsilon=3, ...)``): a σ
    lowered below the run's spends more per step than planned, so the planned steps would
    spend more than the target (ε past 10⁵ here, without an error). The step is refused
    (``PrivacyBudgetExceeded``), nothing changed; the plan's σ put back, it is taken; a σ
    raised above the plan's is used and recorded, and the run ends below its target."""
    data = TensorDataset(
        seeded(lambda: torch.randn(40, 3, dtype=D), 1), seeded(lambda: torch.randint(2, (40,)), 2)
    )
    model = seeded(lambda: nn.Linear(3, 2)).double()
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-5,
        max_grad_norm=1.0, target_epsilon=3.0, steps=4, expected_batch_size=8,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    planned = private.noise_multiplier
    for k, (xb, yb) in enumerate(private.batches()):
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        if k == 1:
            private.optimizer.noise_multiplier = 0.5 * planned
            before = model_state(model)
            with pytest.raises(gradhooks.PrivacyBudgetExceeded):
                private.step()
            assert_untouched(model, before)
            assert private.steps_taken == 1
            private.optimizer.noise_multiplier = planned
        assert private.step()
        private.optimizer.noise_multiplier = 2 * planned if k >= 1 else planned
    sigmas = [sigma for sigma, _, steps in private.accountant.history for _ in range(steps)]
    assert sigmas == [planned, planned, 2 * planned, 2 * planned]
    assert private.steps_taken == 4 and private.epsilon < 3.0
    private.close()


def split_run(max_physical: int | None):
    """A seeded private run over 30 examples (expected batch 12) split into physical batches of
    at most ``max_physical``: each logical batch's physical batches (their example indices)
    and the final weights."""
    data = TensorDataset(torch.arange(30, dtype=D)[:, None], torch.arange(30) % 2)
    model = seeded(lambda: nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.3), data, delta=1e-5,
        max_grad_norm=0.5, noise_multiplier=0.8, steps=4, expected_batch_size=12,
        max_physical_batch_size=max_physical, generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    logical, current = [], []
    for xb, yb in private.batches():
        current.append(xb[:, 0].long().tolist())
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        if private.step():
            logical.append(current)
            current = []
    private.close()
    return logical, [p.detach().clone() for p in model.parameters()]


def test_opacus_batch_memory_manager_physical_batches_of_one_logical_batch():
    """Opacus ``batch_memory_manager_test.py::test_basic`` (``max_physical_batch_size`` 1 to
    the whole batch) and ``test_equivalent_to_one_batch``, through ``make_private``: every
    physical batch holds at most ``max_physical_batch_size`` examples, the physical batches of
    a logical batch are that logical batch cut in order, the step is taken at its end only,
    and the weights are those of the run without splitting (the same noise, the clipped sums
    added in another order: to 1e-12)."""
    whole, weights = split_run(None)
    assert all(len(physical) == 1 for physical in whole)
    for size in (1, 5):
        split, got = split_run(size)
        assert [sum(physical, []) for physical in split] == [p[0] for p in whole]
        assert all(len(b) <= size for physical in split for b in physical)
        assert all(
            len(physical) == max(1, math.ceil(len(sum(physical, [])) / size)) for physical in split
        )
        for a, b in zip(got, weights):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

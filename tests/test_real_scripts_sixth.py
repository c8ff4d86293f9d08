"""Published training scripts, a sixth set, rewritten small, with gradhooks put where their
users put it, each step checked against the float64 per-example loop.

As in the other sets (``test_real_scripts*.py``): each test follows one script of a public
repository (cited in its docstring: repository and path), its model and its loop as written
there, at tiny sizes, on synthetic data, in float64 where the script allows. Here gradhooks
takes the place of the per-example machinery of scripts the other sets leave out: DP-FTRL's
clipping without noise under its tree-aggregated noise (google-research/DP-FTRL), Fishr's
penalty on the variance of the classifier's per-example gradients, differentiated through
(a ``create_graph=True`` backward), EKFAC's second moments in the Kronecker eigenbasis, the
influence functions of ``pytorch_influence_functions`` (each training point's ``grad_z``),
Opacus' image classifier tutorial (batch norm converted, RMSprop, virtual steps) and its
Lightning example, and fastDP's multi-label CelebA script. At every step what the script
computes from gradhooks (the update, the clipped sum, the penalty, the second moments, the
influences) is compared with the same computed from each example's own gradient by a float64
loop; where a step draws noise, the noise is drawn again from a generator of the same seed and
taken off; under bfloat16 autocast (where the script uses it) the comparison has a stated
tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_real_scripts_fifth import assert_all, clipped_sum, loop
from torch import nn

import gradhooks
from harness import one_thread  # noqa: F401 (autouse in this module)

D = torch.float64


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# -- google-research/DP-FTRL: clipping by the hooks, the tree's noise by the script --------------


class SmallNN(nn.Module):
    """DP-FTRL's ``nn.py`` ``SMALL_NN`` (Papernot et al.'s MNIST network) in miniature: two
    strided tanh convolutions, each followed by a stride-1 max pool, and two linear layers."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 4, stride=2, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 2, stride=1)
        self.fc1, self.fc2 = nn.Linear(6 * 2 * 2, 8), nn.Linear(8, classes)

    def forward(self, x):
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)  # [B, 4, 4, 4] from 10x10
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2, 1)  # [B, 6, 2, 2]
        return self.fc2(torch.tanh(self.fc1(x.view(-1, 6 * 2 * 2))))


class CummuNoise:
    """DP-FTRL's ``ftrl_noise.py``: the noise of the tree aggregation protocol, the sum of the
    nodes on the path to step ``t`` (one new node per step, the finished subtrees dropped)."""

    def __init__(self, std: float, shapes, generator: torch.Generator):
        self.std, self.shapes, self.g = std, shapes, generator
        self.binary = [0]
        self.noise_sum = [torch.zeros(s, dtype=D) for s in shapes]
        self.recorded = [[torch.zeros(s, dtype=D) for s in shapes]]

    def __call__(self):
        idx = 0
        while idx < len(self.binary) and self.binary[idx] == 1:
            self.binary[idx] = 0
            for ns, re in zip(self.noise_sum, self.recorded[idx]):
                ns -= re
            idx += 1
        if idx >= len(self.binary):
            self.binary.append(0)
            self.recorded.append([torch.zeros(s, dtype=D) for s in self.shapes])
        for s, ns, re in zip(self.shapes, self.noise_sum, self.recorded[idx]):
            n = self.std * torch.randn(s, generator=self.g, dtype=D)
            ns += n
            re.copy_(n)
        self.binary[idx] = 1
        return self.noise_sum


class FTRLOptimizer(torch.optim.Optimizer):
    """DP-FTRL's ``optimizers.py``: the parameters are the initial ones less the (momentum of
    the) running sum of the gradients plus the tree's noise, over the learning rate's
    inverse ``alpha``."""

    def __init__(self, params, momentum: float):
        self.momentum = momentum
        super().__init__(params, dict(alpha_sum=0.0))

    @torch.no_grad()
    def step(self, args):
        alpha, noise = args
        for group in self.param_groups:
            for p, nz in zip(group["params"], noise):
                state = self.state[p]
                if not state:
                    state["grad_sum"] = torch.zeros_like(p)
                    state["model_sum"] = p.detach().clone()
                    state["momentum"] = torch.zeros_like(p)
                gs, ms = state["grad_sum"], state["model_sum"]
                gs.add_(p.grad)
                if self.momentum == 0:
                    p.copy_(ms + (-gs - nz) / alpha)
                else:
                    state["momentum"].mul_(self.momentum).add_(gs + nz)
                    p.copy_(ms - state["momentum"] / alpha)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dp_ftrl_tree_noise_on_the_running_sum_of_clipped_gradients(momentum):
    """google-research/DP-FTRL ``main.py``: Opacus' engine attached to ``FTRLOptimizer`` with
    ``noise_multiplier=0`` only clips (``p.grad`` the clipped sum over the batch size), and the
    noise comes from ``CummuNoise(noise_multiplier * clip / batch, shapes)``, the tree
    aggregation's, handed to ``optimizer.step((lr, cumm_noise()))``; with ``--momentum`` the
    DP-FTRLM update. Here ``gradhooks.dp_sgd_step(..., noise_multiplier=0,
    expected_batch_size=batch)`` does the clipping. For 4 steps (the tree's nodes dropped and
    added at steps 2 and 4) ``.grad`` is the float64 loop's clipped sum over the batch, and the
    parameters are the script's update of the loop's gradients with the same tree noise."""
    C, SIGMA, B, LR = 1.0, 2.0, 4, 0.4
    torch.manual_seed(0)
    model = SmallNN().to(D)
    twin = copy.deepcopy(model)
    shapes = [p.shape for p in model.parameters()]
    opt = FTRLOptimizer(model.parameters(), momentum=momentum)
    ref = FTRLOptimizer(twin.parameters(), momentum=momentum)
    noise = CummuNoise(SIGMA * C / B, shapes, torch.Generator().manual_seed(3))
    again = CummuNoise(SIGMA * C / B, shapes, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(4):
            x = torch.randn(B, 1, 10, 10, generator=g, dtype=D)
            y = torch.randint(3, (B,), generator=g)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, losses, max_norm=C, noise_multiplier=0.0, expected_batch_size=B
            )
            per = loop(twin, lambda a, b: F.cross_entropy(twin(a), b), x, y)
            want = {n: s / B for n, s in clipped_sum(per, C).items()}
            assert_all(grads_of(model), want, f"step {step}: the clipped mean")
            opt.step((1 / LR, noise()))
            for n, p in twin.named_parameters():
                p.grad = want[n]
            ref.step((1 / LR, again()))
            assert_all(dict(model.named_parameters()), dict(twin.named_parameters()),
                       f"step {step}: the FTRL update")  # fmt: skip
    assert again.binary == [0, 0, 1]  # 4 steps: one node of 4 left in the tree


# -- alexrame/fishr: the variance of the classifier's per-example gradients, differentiated ------


class MovingAverage:
    """DomainBed's ``lib/misc.py`` ``MovingAverage`` with ``oneminusema_correction``: the
    exponential average of each domain's gradient variances, the current one differentiable."""

    def __init__(self, ema: float):
        self.ema, self.data, self.updates = ema, {}, 0

    def update(self, current: dict) -> dict:
        out = {}
        for name, data in current.items():
            data = data.view(1, -1)
            previous = torch.zeros_like(data) if self.updates == 0 else self.data[name]
            averaged = self.ema * previous + (1 - self.ema) * data
            out[name] = averaged / (1 - self.ema)
            self.data[name] = averaged.clone().detach()
        self.updates += 1
        return out


class Fishr:
    """``domainbed/algorithms.py``'s ``Fishr`` in miniature: an MLP featurizer, DomainBed's
    nonlinear ``Classifier`` (``in → in/2 → in/4 → classes``), Adam over both, reset when the
    penalty's weight first counts (``penalty_anneal_iters``). ``per_example(logits, y)`` gives
    ``{name: [batch, numel]}`` with a graph (BackPACK's ``BatchGrad`` under ``create_graph``
    in the script)."""

    def __init__(self, per_example, domains: int = 2, anneal: int = 1, lam: float = 10.0):
        self.featurizer = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 12)).to(D)
        self.classifier = nn.Sequential(
            nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 3)
        ).to(D)
        self.per_example, self.domains, self.anneal, self.lam = per_example, domains, anneal, lam
        self.emas = [MovingAverage(0.95) for _ in range(domains)]
        self.update_count = 0
        self.init_optimizer()

    def params(self):
        return list(self.featurizer.parameters()) + list(self.classifier.parameters())

    def init_optimizer(self):
        self.optimizer = torch.optim.Adam(self.params(), lr=1e-2)

    def penalty(self, logits, y, sizes):
        grads = self.per_example(self, logits, y)
        variances = [{} for _ in range(self.domains)]
        for name, g in grads.items():
            start = 0
            for d, size in enumerate(sizes):
                env = g[start : start + size]
                start += size
                variances[d][name] = (env - env.mean(0, keepdim=True)).pow(2).mean(0)
        variances = [self.emas[d].update(variances[d]) for d in range(self.domains)]
        mean = {n: torch.stack([v[n] for v in variances]).mean(0) for n in variances[0]}
        flat_mean = torch.cat([t.view(-1) for t in mean.values()])
        return (
            sum(
                (torch.cat([t.view(-1) for t in v.values()]) - flat_mean).pow(2).mean()
                for v in variances
            )
            / self.domains
        )

    def update(self, minibatches, backward=None):
        all_x = torch.cat([x for x, _ in minibatches])
        all_y = torch.cat([y for _, y in minibatches])
        logits = self.classifier(self.featurizer(all_x))
        penalty = self.penalty(logits, all_y, [len(x) for x, _ in minibatches])
        nll = F.cross_entropy(logits, all_y)
        weight = 0.0
        if self.update_count >= self.anneal:
            weight = self.lam
            if self.update_count == self.anneal:
                self.init_optimizer()
        self.update_count += 1
        objective = nll + weight * penalty
        self.optimizer.zero_grad()
        (backward or torch.Tensor.backward)(objective)
        grads = {f"p{k}": p.grad.detach().clone() for k, p in enumerate(self.params())}
        self.optimizer.step()
        return penalty.detach(), grads


def fishr_loop_grads(algo, logits, y):
    """The per-example loop of Fishr's later versions (``_get_grads_autograd_fallback``): one
    ``autograd.grad(..., create_graph=True)`` per example."""
    params = list(algo.classifier.named_parameters())
    rows = []
    for i in range(len(y)):
        loss = F.cross_entropy(logits[i : i + 1], y[i : i + 1], reduction="none").sum()
        rows.append(torch.autograd.grad(loss, [p for _, p in params], create_graph=True))
    return {
        n: torch.stack([r[k] for r in rows]).view(len(y), -1) for k, (n, _) in enumerate(params)
    }


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_fishr_penalty_on_per_example_gradient_variances_differentiated_through_grad1():
    """alexrame/fishr ``domainbed/algorithms.py``'s ``Fishr.update``: the classifier's
    per-example gradients of the summed cross-entropy (``loss.backward(inputs=classifier
    params, retain_graph=True, create_graph=True)`` under BackPACK's ``BatchGrad``), their
    variance in each domain, averaged over steps (``MovingAverage``), the penalty their spread
    over the domains, added to the NLL with weight λ from ``penalty_anneal_iters`` on (Adam
    reset then), one ``objective.backward()``. With ``add_hooks(classifier,
    loss_reduction="sum")`` in BackPACK's place, ``grad1`` after the ``create_graph`` backward
    has a graph; the objective's backward is refused unhooked (it runs through that graph, a
    double backward the hooks cannot see: the error names ``paused``) and runs under
    ``h.paused()``. Over 3 steps (λ 0, then 10) the penalty, every parameter's ``.grad`` (the
    featurizer's through the penalty) and the parameters are those of Fishr's own per-example
    ``create_graph`` loop."""
    torch.manual_seed(0)

    def by_grad1(algo, logits, y):
        algo.optimizer.zero_grad()
        loss = F.cross_entropy(logits, y, reduction="none").sum()
        loss.backward(inputs=list(algo.classifier.parameters()), retain_graph=True,
                      create_graph=True)  # fmt: skip
        return {n: p.grad1.clone().view(len(y), -1) for n, p in algo.classifier.named_parameters()}

    algo = Fishr(by_grad1)
    ref = Fishr(fishr_loop_grads)
    ref.featurizer.load_state_dict(algo.featurizer.state_dict())
    ref.classifier.load_state_dict(algo.classifier.state_dict())
    g = torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(algo.classifier, loss_reduction="sum") as h:
        for step in range(3):
            batches = [
                (torch.randn(3, 5, generator=g, dtype=D) + d, torch.randint(3, (3,), generator=g))
                for d in range(2)
            ]
            penalty, grads = algo.update(batches, backward=lambda o: _paused_backward(h, o))
            want_penalty, want = ref.update(batches)
            torch.testing.assert_close(penalty, want_penalty, rtol=1e-10, atol=1e-14)
            assert_all(grads, want, f"step {step}: .grad")
            if step > 0:
                assert want_penalty > 0 and all(t.abs().sum() > 0 for t in grads.values())
            assert_all(dict(enumerate(algo.params())), dict(enumerate(ref.params())),
                       f"step {step}: the parameters")  # fmt: skip
    # the script's ``objective.backward()`` as it stands, with the penalty counted: refused
    torch.manual_seed(0)
    other = Fishr(by_grad1, anneal=0)
    before = copy.deepcopy(other.classifier.state_dict())
    with gradhooks.add_hooks(other.classifier, loss_reduction="sum"):
        with pytest.raises(gradhooks.GradhooksError, match="paused"):
            other.update(batches)
    assert all(torch.equal(before[n], t) for n, t in other.classifier.state_dict().items())


def _paused_backward(h: gradhooks.Hooks, objective: torch.Tensor) -> None:
    with h.paused():
        objective.backward()

"""Published training scripts, a sixth set, rewritten small, with gradhooks put where their
users put it, each step checked against the float64 per-example loop.

As in the other sets (``test_real_scripts*.py``): each test follows one script of a public
repository (cited in its docstring: repository and path), its model and its loop as written
there, at tiny sizes, on synthetic data, in float64 where the script allows. Here gradhooks
takes the place of the per-example machinery of scripts the other sets leave out: DP-FTRL's
clipping under its tree-aggregated noise, Fishr's penalty on the variance of the classifier's
per-example gradients (differentiated through a ``create_graph=True`` backward), EKFAC's second
moments in the Kronecker eigenbasis, the influence functions of ``pytorch_influence_functions``,
Opacus' image and text classifier tutorials and its Lightning example (``make_private`` in
``configure_optimizers``, in float64 and under bfloat16 autocast), fastDP's multi-label CelebA
script, Flower's clients that each train privately between FedAvg rounds, the individual privacy
accounting of DP-SGD from each example's gradient norms, DPDM's noise multiplicity, GSS-Greedy's
sample scores for continual learning, WoodFisher's inverse empirical Fisher, DPSAT's sharpness-
aware DP step, DomainBed's AND-mask over environments, and gpt-neox's gradient noise scale. At
every step what the script computes from gradhooks (the update, the clipped sum, the penalty,
the second moments, the influences, the scores, the inverse Fisher, the noise scale) is compared
with the same computed from each example's own gradient by a float64 loop (or by the script's
own code on a float64 twin); where a step draws noise, the noise is drawn again from a generator
of the same seed and taken off; under bfloat16 autocast the comparison has a stated tolerance.
Where the script's own form is refused (a batch norm in training, a mean loss handed to the DP
step, copies of the examples along the batch, a double backward through the hooks), the test
checks the refusal and its remedy; Lightning's read-ahead of the next batch, refused by
``private.batches()``, is recorded as a strict xfail.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_real_scripts_fifth import assert_all, clipped_sum, denoised, flat, follow, loop
from torch import nn

import gradhooks
from harness import (  # noqa: F401 (one_thread: autouse)
    assert_untouched,
    hf,
    model_state,
    one_thread,
    tiny_bert_config,
)

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


# -- Thrandis/EKFAC-pytorch: second moments in the Kronecker eigenbasis, from grad1 --------------


class EKFACNet(nn.Module):
    """A convolution and two linear layers, the layer kinds ``EKFAC`` preconditions."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc1, self.fc2 = nn.Linear(3 * 3 * 3, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


class ScriptEKFAC:
    """``ekfac.py``'s ``EKFAC(net, eps, sua=False, ra=False, alpha=1.0, update_freq=1)``: its
    own hooks save each layer's input and ``grad_output * batch``; ``_compute_kfe`` takes the
    eigenvectors of ``x xᵀ`` and ``gy gyᵀ`` (a convolution's input as patches, its positions as
    rows); ``_precond_intra`` projects the gradient into that basis, divides it by the batch's
    second moment there, ``m2`` (each example's gradient projected, squared, averaged) plus
    ``eps``, and projects back into ``.grad``."""

    def __init__(self, net: nn.Module, eps: float):
        self.eps, self.saved, self.m2 = eps, {}, {}
        self.layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        for m in self.layers:
            m.register_forward_pre_hook(lambda mod, i: self.saved.__setitem__((mod, "x"), i[0]))
            m.register_full_backward_hook(
                lambda mod, gi, go: self.saved.__setitem__((mod, "gy"), go[0] * go[0].size(0))
            )

    def rows(self, mod):
        """The layer's inputs (bias-augmented) and output-gradients as ``[batch, positions,
        n]``."""
        x, gy = self.saved[(mod, "x")], self.saved[(mod, "gy")]
        if isinstance(mod, nn.Conv2d):
            x = F.unfold(x, mod.kernel_size, padding=mod.padding, stride=mod.stride)
            x = x.transpose(1, 2)  # the gathering filter's patches
            gy = gy.flatten(2).transpose(1, 2)
        else:
            x, gy = x[:, None], gy[:, None]
        return torch.cat([x, torch.ones_like(x[..., :1])], -1), gy

    def step(self):
        for mod in self.layers:
            x, gy = self.rows(mod)
            bs = x.shape[0]
            xs, gs = x.flatten(0, 1), gy.flatten(0, 1)
            kfe_x = torch.linalg.eigh(xs.T @ xs / len(xs)).eigenvectors
            kfe_gy = torch.linalg.eigh(gs.T @ gs / len(gs)).eigenvectors
            x_kfe, gy_kfe = x @ kfe_x, gy @ kfe_gy
            per = torch.einsum("bpo,bpi->boi", gy_kfe, x_kfe)  # each example's, in the basis
            self.m2[mod] = per.pow(2).sum(0) / bs
            g_kfe = per.sum(0) / bs
            g_nat = kfe_gy @ (g_kfe / (self.m2[mod] + self.eps)) @ kfe_x.T
            mod.bias.grad = g_nat[:, -1].clone()
            mod.weight.grad = g_nat[:, :-1].reshape(mod.weight.shape).clone()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_ekfac_intra_batch_second_moments_from_grad1_and_the_kfac_factors():
    """Thrandis/EKFAC-pytorch ``ekfac.py`` as its README trains with it (``loss.backward()``,
    ``preconditioner.step()``, ``optimizer.step()``), with the intra-batch estimate
    (``ra=False``, ``alpha=1``) and ``update_freq=1``. With gradhooks in place of its hooks,
    ``add_hooks(net, quantities=("grad1", "kfac"))`` gives the eigenbases (of
    ``h.kfac_factors()``'s ``A`` and ``G``, whatever their scale) and ``m2``, the mean square of
    each example's gradient (``grad1``, bias as the last column) in that basis. Over 3 SGD
    steps ``m2`` is that of the per-example loop's gradients, and the preconditioned ``.grad``
    and the parameters are the script's own, computed by its hooks on a float64 twin."""
    EPS = 0.1
    torch.manual_seed(0)
    net = EKFACNet().to(D)
    twin = copy.deepcopy(net)
    script = ScriptEKFAC(twin, EPS)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    layers = {"conv": net.conv, "fc1": net.fc1, "fc2": net.fc2}
    g = torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(net, quantities=("grad1", "kfac")) as h:
        for step in range(3):
            x = torch.randn(4, 2, 6, 6, generator=g, dtype=D)
            y = torch.randint(3, (4,), generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            factors = h.kfac_factors()
            per = loop(twin, lambda a, b: F.cross_entropy(twin(a), b), x, y)
            for name, mod in layers.items():
                f = factors[f"{name}.weight"]
                kfe_x = torch.linalg.eigh(f.A.detach()).eigenvectors
                kfe_gy = torch.linalg.eigh(f.G.detach()).eigenvectors
                g1 = torch.cat([mod.weight.grad1.flatten(2), mod.bias.grad1[..., None]], -1)
                m2 = (kfe_gy.T @ g1 @ kfe_x).pow(2).mean(0)
                rows = torch.cat(
                    [per[f"{name}.weight"].flatten(2), per[f"{name}.bias"][..., None]], -1
                )
                torch.testing.assert_close(m2, (kfe_gy.T @ rows @ kfe_x).pow(2).mean(0))
                g_kfe = kfe_gy.T @ g1.mean(0) @ kfe_x
                g_nat = kfe_gy @ (g_kfe / (m2 + EPS)) @ kfe_x.T
                mod.bias.grad = g_nat[:, -1].clone()
                mod.weight.grad = g_nat[:, :-1].reshape(mod.weight.shape).clone()
            opt.step()
            h.clear()
            ref_opt.zero_grad()
            F.cross_entropy(twin(x), y).backward()
            script.step()
            ref_opt.step()
            assert_all(dict(net.named_parameters()), dict(twin.named_parameters()),
                       f"step {step}: the parameters")  # fmt: skip


# -- nimarb/pytorch_influence_functions: grad_z of every training point from one backward --------


def calc_loss(y, t):
    """``influence_function.py``'s ``calc_loss``: ``nll_loss`` of ``log_softmax``, a mean."""
    return F.nll_loss(F.log_softmax(y, dim=1), t, reduction="mean")


def hvp(y, w, v):
    """``influence_function.py``'s ``hvp``: a double backward through ``create_graph``."""
    first = torch.autograd.grad(y, w, retain_graph=True, create_graph=True)
    dot = sum(torch.sum(g * e) for g, e in zip(first, v))
    return torch.autograd.grad(dot, w, create_graph=True)


def s_test(z_test, t_test, model, z_loader, damp=0.01, scale=25.0, recursion_depth=3):
    """``influence_function.py``'s ``s_test``: LiSSA's recursion ``h ← v + (1 - damp) h -
    H h / scale`` on the loader's first batch, ``v`` the test point's gradient."""
    v = list(torch.autograd.grad(calc_loss(model(z_test), t_test), list(model.parameters()),
                                 create_graph=True))  # fmt: skip
    h_estimate = v.copy()
    for _ in range(recursion_depth):
        for x, t in z_loader:
            hv = hvp(calc_loss(model(x), t), list(model.parameters()), h_estimate)
            h_estimate = [a + (1 - damp) * b - c / scale for a, b, c in zip(v, h_estimate, hv)]
            break
    return [h.detach() for h in h_estimate]


def test_influence_functions_grad_z_of_the_training_set_from_grad1_against_its_loop():
    """nimarb/pytorch_influence_functions ``calc_influence_function.py``'s
    ``calc_influence_single``: ``s_test`` of a test point (LiSSA over the training loader, a
    double backward), then for each training point alone ``grad_z`` (one forward and backward
    per point) and its influence ``-Σ grad_z · s_test / n``, sorted into the harmful and the
    helpful. With the model hooked once, for the whole script, the training set's ``grad_z``
    are ``grad1`` of one backward of the mean loss. The script's ``s_test`` run on the hooked
    model as it stands is refused (its ``hvp`` differentiates a ``create_graph`` gradient:
    the error names ``paused``); run under ``h.paused()`` it is the unhooked model's. The
    influences and their order are the script's loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(6)
    train_x, train_t = torch.randn(6, 4, generator=g, dtype=D), torch.randint(3, (6,), generator=g)
    test_x, test_t = torch.randn(1, 4, generator=g, dtype=D), torch.randint(3, (1,), generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train_x, train_t), batch_size=2, shuffle=False
    )
    want_s = s_test(test_x, test_t, twin, loader)
    want = []
    for i in range(6):  # the script's loop over the training set, one point at a time
        grad_z = torch.autograd.grad(calc_loss(twin(train_x[i : i + 1]), train_t[i : i + 1]),
                                     list(twin.parameters()))  # fmt: skip
        want.append(-sum(torch.sum(k * j) for k, j in zip(grad_z, want_s)) / 6)
    want = torch.stack(want)
    with gradhooks.add_hooks(model) as h:
        with pytest.raises(gradhooks.GradhooksError, match="paused"):
            s_test(test_x, test_t, model, loader)
        model.zero_grad()
        with h.paused():
            got_s = s_test(test_x, test_t, model, loader)
        assert_all(dict(enumerate(got_s)), dict(enumerate(want_s)), "s_test")
        calc_loss(model(train_x), train_t).backward()
        got = -sum((p.grad1 * s).flatten(1).sum(1) for p, s in zip(model.parameters(), got_s)) / 6
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert got.argsort().tolist() == want.argsort().tolist()  # the harmful, then the helpful


# -- pytorch/opacus tutorials: a ResNet with its batch norm converted, RMSprop, virtual steps ----


class TinyResNet(nn.Module):
    """torchvision's ``resnet18`` as the tutorial builds it, in miniature: a stem (convolution,
    batch norm, ReLU), one ``BasicBlock`` with a strided downsample (1x1 convolution and batch
    norm), global average pooling and the classifier."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b_conv1 = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False)
        self.b_bn1 = nn.BatchNorm2d(8)
        self.b_conv2, self.b_bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.downsample = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        out = self.b_bn2(self.b_conv2(F.relu(self.b_bn1(self.b_conv1(x)))))
        x = F.relu(out + self.downsample(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def cross_entropy_rows(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def run_checked(private, model, twin, ref_opt, bound, expected, losses_of, first=None) -> list[int]:
    """The loop of ``make_private``'s docstring over ``private.batches()``, ``losses_of(model,
    *batch)`` each physical batch's per-example losses. At each logical step the gradient the
    wrapped optimizer steps on, times the expected batch size, the noise drawn again and taken
    off, is the float64 loop's clipped sum on the twin over the logical batch; the twin steps
    on that gradient with ``ref_opt`` and its parameters are the model's. ``first(model,
    *batch)``, if given, runs on the first batch before its backward (a mistake to be refused).
    Returns the physical batches' sizes."""
    seen = []
    handle = private.optimizer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(grads_of(model))
    )
    sigma, sizes = private.noise_multiplier, []
    physical, state = [], None
    for batch in private.batches():
        if not physical:
            state = private.optimizer.generator.get_state()
        if first is not None and not sizes:
            first(model, *batch)
        physical.append(batch)
        sizes.append(len(batch[0]))
        private.backward(losses_of(model, *batch))
        if not private.step():
            continue
        whole = [torch.cat(ts) for ts in zip(*physical)]
        physical = []
        per = loop(twin, lambda *rows: losses_of(twin, *rows).sum(), *whole)
        noise = torch.Generator().set_state(state)
        got = {n: t * expected - sigma * bound * torch.randn(t.shape, generator=noise, dtype=D)
               for n, t in seen[-1].items()}  # fmt: skip
        what = f"step {private.steps_taken}"
        assert_all(got, clipped_sum(per, bound), f"{what}: the clipped sum", rtol=1e-9, atol=1e-11)
        for n, p in twin.named_parameters():
            if n in seen[-1]:
                p.grad = seen[-1][n]
        ref_opt.step()
        assert_all(dict(model.named_parameters()), dict(twin.named_parameters()),
                   f"{what}: the optimizer's update")  # fmt: skip
    handle.remove()
    assert len(seen) == private.steps_taken
    return sizes


def test_opacus_image_classifier_tutorial_converted_resnet_rmsprop_and_virtual_steps():
    """pytorch/opacus ``tutorials/building_image_classifier.ipynb``: ``resnet18`` is refused by
    ``ModuleValidator`` for its batch norms, ``ModuleValidator.fix`` puts GroupNorm in their
    place, ``RMSprop(lr=1e-3)``, ``make_private_with_epsilon(target_epsilon=50, ...,
    max_grad_norm=1.2)`` and ``BatchMemoryManager(max_physical_batch_size=...)`` around the
    loop. Here the hooked ResNet is refused at its first batch norm (``MixedExamplesError``),
    ``gradhooks.convert_batch_norm`` converts it, and ``gradhooks.make_private(...,
    target_epsilon=50, max_physical_batch_size=3)`` runs the tutorial's loop. At each of 3
    logical steps (Poisson batches of 8 expected, split into physical batches of at most 3) the
    gradient RMSprop steps on, the noise taken off, is the float64 loop's clipped sum over the
    expected batch, and the parameters are RMSprop's update of it."""
    C, E = 1.2, 8
    torch.manual_seed(0)
    model = TinyResNet().to(D)
    g = torch.Generator().manual_seed(8)
    images = torch.randn(48, 3, 6, 6, generator=g, dtype=D)
    labels = torch.randint(3, (48,), generator=g)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match="bn1"):
            F.cross_entropy(model(images[:4]), labels[:4]).backward()
    model.zero_grad(set_to_none=True)
    model = gradhooks.convert_batch_norm(model)
    assert isinstance(model.bn1, nn.GroupNorm) and isinstance(model.downsample[1], nn.GroupNorm)
    twin = copy.deepcopy(model)
    inner = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.RMSprop(twin.parameters(), lr=1e-3)
    private = gradhooks.make_private(
        model, inner, torch.utils.data.TensorDataset(images, labels), target_epsilon=50.0,
        delta=1e-5, steps=3, expected_batch_size=E, max_grad_norm=C,
        max_physical_batch_size=3, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    sizes = run_checked(private, model, twin, ref_opt, C, E, cross_entropy_rows)
    private.close()
    assert max(sizes) <= 3 and len(sizes) > 3
    assert private.steps_taken == 3
    assert 0 < private.epsilon <= 50.0


# -- awslabs/fast-differential-privacy: multi-label CelebA --------------------------------------


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "BiTFiT"])
def test_fastdp_celeba_multi_label_bce_summed_over_attributes_with_accumulation(mode):
    """awslabs/fast-differential-privacy ``examples/image_classification/CelebA_TIMM.py``: a
    timm ResNet fixed by ``ModuleValidator.fix`` (GroupNorm), 40 binary attributes,
    ``BCEWithLogitsLoss(reduction="none")`` summed over the attributes (``.sum(dim=1)``: each
    image's loss) and averaged over the mini-batch, fastDP's ``PrivacyEngine`` on Adam with its
    automatic clipping, ``virtual_step()`` over ``bs // mini_bs`` mini-batches, with
    ``--clipping_mode BK-MixOpt`` (book-keeping) or ``BK-ghost`` (ghost clipping:
    ``method="ghost"`` here), and with ``--clipping_mode BiTFiT`` every weight but the biases
    frozen. Here
    ``gradhooks.DPOptimizer(clipping="automatic")`` takes the engine's place: the per-attribute
    losses ``[batch, 5]`` handed to it are refused (one loss per example), their sum over the
    attributes is each image's. After each of 2 logical steps of 2 mini-batches ``.grad``,
    the noise taken off, is the loop's automatically clipped sum over the batch size; the frozen
    weights do not move."""
    C, SIGMA, BS, MINI = 1.0, 0.7, 4, 2
    torch.manual_seed(0)
    net = gradhooks.convert_batch_norm(TinyResNet(classes=5)).to(D)
    if mode == "BiTFiT":
        for name, p in net.named_parameters():
            if ".bias" not in name and name != "fc.bias":
                p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    twin = copy.deepcopy(net)
    criterion = nn.BCEWithLogitsLoss(reduction="none")
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    noise, again = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    g = torch.Generator().manual_seed(10)
    with gradhooks.add_hooks(net, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            opt, h, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=BS,
            clipping="automatic", generator=noise, method="ghost" if mode == "BK-ghost" else None,
        )  # fmt: skip
        for step in range(2):
            inputs = torch.rand(BS, 3, 6, 6, generator=g, dtype=D)
            targets = torch.randint(2, (BS, 5), generator=g).to(D)
            for k in range(BS // MINI):
                rows = slice(k * MINI, (k + 1) * MINI)
                outputs = net(inputs[rows])
                if step == 0 and k == 0:
                    with pytest.raises(gradhooks.GradhooksError, match=r"\[2, 5\]|\(2, 5\)"):
                        dp.backward(criterion(outputs, targets[rows]))
                    outputs = net(inputs[rows])
                dp.backward(criterion(outputs, targets[rows]).sum(dim=1))
            dp.step()
            per = loop(twin, lambda a, b: criterion(twin(a), b).sum(), inputs, targets)
            got = denoised(net, again, SIGMA * C, BS)
            want = clipped_sum(per, C, automatic=True)
            assert_all(got, want, f"step {step}", rtol=1e-9, atol=1e-11)
            dp.zero_grad()
            follow(twin, net)
    for n, p in net.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and not hasattr(p, "grad1"), n


# -- adap/flower examples/opacus: FedAvg over clients that each train privately ------------------


class FlowerNet(nn.Module):
    """``opacus_fl/task.py``'s ``Net`` (the PyTorch tutorial's LeNet) in miniature, its
    ``x.view(-1, 16 * 5 * 5)`` kept (here ``4 * 1 * 1`` on 10x10 images)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.pool, self.conv2 = (
            nn.Conv2d(3, 2, 3),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(2, 4, 3),
        )
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 4 * 1 * 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def get_weights(net):
    return [v.cpu().numpy() for v in net.state_dict().values()]


def set_weights(net, parameters):
    keys = net.state_dict().keys()
    net.load_state_dict({k: torch.tensor(v) for k, v in zip(keys, parameters)}, strict=True)


def test_flower_opacus_clients_make_private_each_round_and_fedavg_of_their_weights():
    """adap/flower ``examples/opacus/opacus_fl``: each client's ``fit`` sets the global weights
    into its own model (``set_weights``: ``load_state_dict`` of new tensors), makes a fresh
    SGD (momentum 0.9), calls ``make_private`` again every round (σ 1.0 for even partitions,
    1.5 for odd ones), trains one epoch, logs ε and returns ``get_weights`` and its number of
    examples; the server's FedAvg averages the weights by those numbers. With
    ``gradhooks.make_private`` (closed at the end of ``fit``) over 2 rounds of 2 clients, each
    client's every step is the float64 loop's clipped sum plus the noise, its weights the
    loop's, each round's ε is that of its own σ over its steps, and the global weights are the
    average of the loop's clients. A ``fit`` that leaves its training open (no ``close()``)
    has the next ``make_private`` on that model refused (``StateError``)."""
    C, E = 1.0, 4
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(12)
    parts = [
        torch.utils.data.TensorDataset(torch.randn(12, 3, 10, 10, generator=g, dtype=D),
                                       torch.randint(3, (12,), generator=g))
        for _ in range(2)
    ]  # fmt: skip
    clients = [FlowerNet().to(D) for _ in parts]
    twins = [copy.deepcopy(c) for c in clients]
    global_weights = get_weights(FlowerNet().to(D))
    for rnd in range(2):
        results = []
        for pid, (model, twin, data) in enumerate(zip(clients, twins, parts)):
            set_weights(model, global_weights)
            set_weights(twin, global_weights)
            sigma = 1.0 if pid % 2 == 0 else 1.5
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
            private = gradhooks.make_private(
                model, optimizer, data, noise_multiplier=sigma, delta=1e-5, epochs=1,
                expected_batch_size=E, max_grad_norm=C,
                generator=torch.Generator().manual_seed(10 * rnd + pid),
            )  # fmt: skip
            run_checked(private, model, twin, ref_opt, C, E, cross_entropy_rows)
            private.close()
            accountant = gradhooks.PrivacyAccountant()
            accountant.step(noise_multiplier=sigma, sample_rate=E / 12, steps=3)
            assert private.steps_taken == 3
            assert private.epsilon == pytest.approx(accountant.epsilon(1e-5), rel=1e-12)
            results.append((get_weights(model), len(data)))
            assert not any(hasattr(p, "grad1") for p in model.parameters())
        total = sum(n for _, n in results)
        global_weights = [
            sum(w[k] * n for w, n in results) / total for k in range(len(results[0][0]))
        ]
        want = [
            sum(t.detach() * len(d) for t, d in zip(ts, parts)) / total
            for ts in zip(*(list(tw.state_dict().values()) for tw in twins))
        ]
        for k, (got, w) in enumerate(zip(global_weights, want)):
            torch.testing.assert_close(torch.tensor(got), w, msg=f"round {rnd}: weight {k}")
    # a fit that forgets ``close()`` (Opacus' engine needs none): the next round's
    # make_private is refused before it hooks the model a second time
    model = clients[0]
    kwargs = dict(noise_multiplier=1.0, delta=1e-5, epochs=1, expected_batch_size=E,
                  max_grad_norm=C)  # fmt: skip
    private = gradhooks.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), parts[0],
                                     **kwargs)  # fmt: skip
    with pytest.raises(gradhooks.StateError, match="make_private run that was not closed") as info:
        gradhooks.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), parts[0],
                               **kwargs)  # fmt: skip
    assert "call close() on that run" in str(info.value)
    assert gradhooks.hooks_of(model) is private.hooks  # (the first run's, untouched)
    private.close()
    again = gradhooks.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), parts[0],
                                   **kwargs)  # fmt: skip
    again.close()


# -- dayu11/individual_privacy_of_DPSGD: each example's privacy from its gradient norms ---------


class IndividualPrivacy:
    """``idp_tracker.py``'s ``PrivacyLossTracker`` in miniature: each example's gradient norm,
    capped at the clipping bound and rounded to the nearest multiple of ``rounding``, makes
    its own noise multiplier ``σ·C/norm``; every step adds that multiplier's RDP of the
    sampled Gaussian (here by gradhooks' accountant, one history per example)."""

    def __init__(self, n: int, q: float, sigma: float, clip: float, rounding: float):
        self.q, self.sigma, self.clip, self.rounding = q, sigma, clip, rounding
        self.norms = torch.full((n,), clip, dtype=D)
        self.history: list[list[float]] = [[] for _ in range(n)]

    def update_norm(self, norms: torch.Tensor, idx: torch.Tensor) -> None:
        levels = torch.arange(1, round(self.clip / self.rounding), dtype=D) * self.rounding
        capped = norms.clamp(max=self.clip)
        nearest = levels[(capped[:, None] - levels).abs().argmin(1)]
        self.norms[idx] = torch.where(capped >= self.clip, self.clip, nearest)

    def update_loss(self) -> None:
        for h, norm in zip(self.history, self.norms.tolist()):
            h.append(self.sigma * self.clip / norm)

    def eps(self, delta: float) -> list[float]:
        done: dict[tuple, float] = {}
        for h in map(tuple, self.history):
            if h not in done:
                acc = gradhooks.PrivacyAccountant("rdp")
                for sigma in h:
                    acc.step(noise_multiplier=sigma, sample_rate=self.q)
                done[h] = acc.epsilon(delta)
        return [done[tuple(h)] for h in self.history]


def test_individual_privacy_tracker_from_per_example_norms_of_each_step():
    """dayu11/individual_privacy_of_DPSGD ``main.py``: a ResNet-20 trained by DP-SGD with
    BackPACK's ``BatchGrad`` (``CrossEntropyLoss(reduction="sum")``, ``process_grad_batch``
    clips each example to ``--clip`` and averages, the noise ``σ·C/batchsize`` added to every
    parameter but the batch norms', whose gradients are dropped), and ``update_norms``: the
    whole training set's per-example gradient norms in eval mode (``get_grad_batch_norms``,
    batch norms left out), handed to ``PrivacyLossTracker``, whose ``update_loss`` after each
    step adds each example's RDP at its own noise multiplier. The training step's batch norms
    in train mode are refused by gradhooks (``MixedExamplesError``): the model is converted
    (``convert_batch_norm``, whose GroupNorms are left out as the script leaves its batch norms
    out). With ``add_hooks(net, "sum", quantities=("norms",))`` the norms are ``h.norms()`` of
    one backward, and the step ``dp_sgd_step(expected_batch_size=batchsize)``. Over 3 steps the
    norms are the loop's, each step's ``.grad``, the noise taken off, the loop's clipped mean,
    and the tracker's rounded norms and noise multipliers are those of the loop's norms: the
    examples at the bound at every step have the population's ε, the others less."""
    N, BS, C, SIGMA, ROUND = 12, 4, 3.0, 1.5, 0.1
    torch.manual_seed(0)
    net = TinyResNet().to(D)
    g = torch.Generator().manual_seed(14)
    images, labels = (
        torch.randn(N, 3, 6, 6, generator=g, dtype=D),
        torch.randint(3, (N,), generator=g),
    )
    with gradhooks.add_hooks(net, loss_reduction="sum", quantities=("norms",)):
        with pytest.raises(gradhooks.MixedExamplesError, match="bn1"):
            F.cross_entropy(net(images[:BS]), labels[:BS], reduction="sum").backward()
    net = gradhooks.convert_batch_norm(net)
    for name, p in net.named_parameters():
        if "bn" in name:
            p.requires_grad_(False)
    twin = copy.deepcopy(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                          weight_decay=1e-3)  # fmt: skip
    mine = IndividualPrivacy(N, BS / N, SIGMA, C, ROUND)
    theirs = IndividualPrivacy(N, BS / N, SIGMA, C, ROUND)
    noise, again = torch.Generator().manual_seed(15), torch.Generator().manual_seed(15)
    order = torch.randperm(N, generator=g)

    def per_example(x, y):
        return loop(twin, lambda a, b: F.cross_entropy(twin(a), b, reduction="sum"), x, y)

    with gradhooks.add_hooks(net, loss_reduction="sum", quantities=("norms",)) as h:
        for step in range(N // BS):
            net.eval()  # update_norms: the whole training set, in batches
            for start in range(0, N, BS):
                idx = torch.arange(start, start + BS)
                net.zero_grad()
                F.cross_entropy(net(images[idx]), labels[idx], reduction="sum").backward()
                norms = h.norms()
                want = flat(per_example(images[idx], labels[idx])).norm(dim=1)
                torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-13)
                mine.update_norm(norms, idx)
                theirs.update_norm(want, idx)
                assert torch.equal(mine.norms, theirs.norms)
            net.train()
            idx = order[step * BS : (step + 1) * BS]
            opt.zero_grad()
            losses = F.cross_entropy(net(images[idx]), labels[idx], reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=SIGMA,
                                  expected_batch_size=BS, generator=noise)  # fmt: skip
            got = denoised(net, again, SIGMA * C, BS)
            want = clipped_sum(per_example(images[idx], labels[idx]), C)
            assert_all(got, want, f"step {step}: the clipped sum", rtol=1e-9, atol=1e-11)
            opt.step()
            mine.update_loss()
            theirs.update_loss()
            follow(twin, net)
    assert mine.history == theirs.history
    eps = mine.eps(1e-5)
    population = gradhooks.PrivacyAccountant("rdp")
    population.step(noise_multiplier=SIGMA, sample_rate=BS / N, steps=N // BS)
    at_bound = [all(sigma == SIGMA for sigma in h) for h in mine.history]
    assert 0 < sum(at_bound) < N, mine.history
    for e, bound in zip(eps, at_bound):
        assert (
            e == pytest.approx(population.epsilon(1e-5)) if bound else e < population.epsilon(1e-5)
        )


# -- nv-tlabs/DPDM: noise multiplicity, each example's loss over K noised copies -----------------


class TinyNCSNpp(nn.Module):
    """DPDM's ``model/ncsnpp.py`` (Song et al.'s NCSN++) in miniature: the noise level's
    sinusoidal embedding through two linear layers, a class embedding with one more row for
    the dropped label (classifier-free guidance), added to the features of an input
    convolution, GroupNorm, SiLU and an output convolution."""

    def __init__(self, channels: int = 1, width: int = 4, classes: int = 3):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, width))
        self.label = nn.Embedding(classes + 1, width)
        self.conv_in, self.norm = nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(2, width)
        self.conv_out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x, c_noise, y):
        freqs = torch.exp(-torch.arange(2, dtype=x.dtype))
        emb = torch.cat(
            [torch.sin(c_noise[:, None] * freqs), torch.cos(c_noise[:, None] * freqs)], 1
        )
        h = self.conv_in(x) + (self.temb(emb) + self.label(y))[:, :, None, None]
        return self.conv_out(F.silu(self.norm(h)))


class EDMDenoiser(nn.Module):
    """DPDM's ``denoiser.py`` ``EDMDenoiser``: Karras et al.'s preconditioning of the network
    by the noise level of each row."""

    def __init__(self, model: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        self.model, self.sigma_data = model, sigma_data

    def forward(self, x, sigma, y):
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + sigma**2).sqrt()
        return c_skip * x + c_out * self.model(c_in * x, 0.25 * torch.log(sigma).reshape(-1), y)


class NoiseCopies(nn.Module):
    """The denoiser called on ``[batch, K, ...]``: each example's K noised copies kept on
    their own dimension (the noise levels ``[batch, K, 1, 1, 1]`` and labels ``[batch, K]``
    with them), so that the batch the hooks see is the examples'."""

    def __init__(self, denoiser: nn.Module):
        super().__init__()
        self.denoiser = denoiser

    def forward(self, x_noisy, sigma, y):
        out = self.denoiser(x_noisy.flatten(0, 1), sigma.flatten(0, 1), y.flatten(0, 1))
        return out.unflatten(0, x_noisy.shape[:2])


def edm_loss(denoise, x, y, draws, k: int, stacked: bool):
    """``score_losses.py``'s ``EDMLoss.get_loss`` with ``n_noise_samples=K``: the labels
    dropped with probability 0.1 and repeated K times, ``log σ ~ N(P_mean, P_std)`` and the
    noise drawn per copy, the weighted squared error of the denoised copies, averaged per
    example (``[batch]``). The draws are given (``draws``: the drop mask, the normals of
    ``log σ``, the noise), so that the loop can take each example's rows. ``stacked``: the
    denoiser takes ``[batch, K, ...]`` (:class:`NoiseCopies`), else the script's
    ``x_noisy.reshape(-1, ...)``."""
    drop, normal, noise = draws
    y = torch.where(drop, 3, y).repeat_interleave(k).view(len(x), k)
    sigma = (-1.2 + 1.2 * normal).exp()[:, :, None, None, None]
    x_repeated = x.unsqueeze(1).repeat_interleave(k, dim=1)
    x_noisy = x_repeated + sigma * noise
    w = (sigma**2 + 0.25) / (sigma * 0.5) ** 2
    if stacked:
        pred = denoise(x_noisy, sigma, y)
    else:
        pred = denoise(x_noisy.reshape(-1, *x.shape[1:]), sigma.reshape(-1, 1, 1, 1), y.reshape(-1))
        pred = pred.reshape(len(x), k, *x.shape[1:])
    loss = w * (pred - x_repeated) ** 2
    return loss.reshape(len(x), -1).mean(-1)


def test_dpdm_noise_multiplicity_each_examples_copies_averaged_before_clipping():
    """nv-tlabs/DPDM ``runners/train_dpdm_base.py``: an EDM denoiser over NCSN++ trained by
    its Opacus fork's ``make_private_with_epsilon(..., noise_multiplicity=K)`` with
    ``BatchMemoryManager``, the loss ``EDMLoss(n_noise_samples=K).get_loss(model, x, y)``
    (each image noised K times, ``model(x_noisy.reshape(-1, ...), ...)``, the error averaged
    per image), Adam, and an EMA of the weights. With gradhooks the script's call is refused
    (the hooked model's batch is ``batch·K`` while the losses are ``[batch]``: the message
    says to keep the copies on their own dimension); with the denoiser called on
    ``[batch, K, ...]`` (:class:`NoiseCopies`) ``DPOptimizer`` over Adam, physical batches of
    2, gives at each of 2 steps ``.grad``, the noise taken off, the float64 loop's clipped sum
    of each image's gradient of its K copies' mean loss, with the same draws."""
    C, SIGMA, B, K = 1.0, 0.8, 4, 3
    torch.manual_seed(0)
    model = NoiseCopies(EDMDenoiser(TinyNCSNpp())).to(D)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    noise, again = torch.Generator().manual_seed(16), torch.Generator().manual_seed(16)
    g = torch.Generator().manual_seed(17)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(opt, h, max_grad_norm=C, noise_multiplier=SIGMA,
                                   expected_batch_size=B, generator=noise)  # fmt: skip
        for step in range(2):
            x = torch.rand(B, 1, 4, 4, generator=g, dtype=D) * 2 - 1
            y = torch.randint(3, (B,), generator=g)
            draws = (torch.rand(B, generator=g) < 0.1, torch.randn(B, K, generator=g, dtype=D),
                     torch.randn(B, K, 1, 4, 4, generator=g, dtype=D))  # fmt: skip
            if step == 0:  # the script's own call, the copies along the batch
                with pytest.raises(gradhooks.GradhooksError, match="views|copies|repeat"):
                    dp.backward(edm_loss(model.denoiser, x[:2], y[:2],
                                         [d[:2] for d in draws], K, stacked=False))  # fmt: skip
            for half in (slice(0, 2), slice(2, 4)):  # BatchMemoryManager's physical batches
                dp.backward(edm_loss(model, x[half], y[half], [d[half] for d in draws], K, True))
            dp.step()
            per = [
                loop(twin, lambda a, b, *d: edm_loss(twin, a, b, d, K, True).sum(), x, y, *draws)
            ][0]
            got = denoised(model, again, SIGMA * C, B)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            dp.zero_grad()
            follow(twin, model)


def test_opacus_text_classifier_tutorial_bert_last_layer_and_head_with_the_loss_inside():
    """pytorch/opacus ``tutorials/building_text_classifier.ipynb``: ``BertForSequenceClassification``
    with every parameter frozen but the last encoder layer's, the pooler's and the classifier's,
    ``AdamW(lr=5e-4, eps=1e-8)``, ``make_private_with_epsilon(target_epsilon=7.5, target_delta=
    1 / len(train_dataloader), max_grad_norm=0.1)``, ``BatchMemoryManager`` and, in the loop,
    ``loss = model(**inputs)[0]`` (the model's own mean over the batch). With
    ``gradhooks.make_private`` the tutorial's δ, one over the number of batches, is above
    ``1 / n`` and warns; the model's mean loss handed to ``private.backward`` is refused (one
    loss per example), and the per-example cross-entropy of ``outputs.logits`` is each step's
    clipped sum, the noise taken off, of the float64 loop, with AdamW's update of it; the frozen
    layers do not move."""
    config = tiny_bert_config(num_labels=3)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = hf("BertForSequenceClassification")(config).to(D)
    model.train()
    for p in model.parameters():
        p.requires_grad = False
    for layer in (model.bert.encoder.layer[-1], model.bert.pooler, model.classifier):
        for p in layer.parameters():
            p.requires_grad = True
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(18)
    n, seq = 32, 6
    ids = torch.randint(1, 20, (n, seq), generator=g)
    lengths = torch.randint(3, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).long()
    data = torch.utils.data.TensorDataset(ids * mask, mask, torch.zeros_like(ids),
                                          torch.randint(3, (n,), generator=g))  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-4, eps=1e-8)
    ref_opt = torch.optim.AdamW(
        [p for p in twin.parameters() if p.requires_grad], lr=5e-4, eps=1e-8
    )

    def outputs(m, input_ids, attention_mask, token_type_ids, labels):
        return m(input_ids=input_ids, attention_mask=attention_mask,
                 token_type_ids=token_type_ids, labels=labels)  # fmt: skip

    def losses_of(m, *batch):
        return F.cross_entropy(outputs(m, *batch).logits, batch[-1], reduction="none")

    with pytest.warns(gradhooks.GradhooksWarning, match="delta|δ"):
        private = gradhooks.make_private(
            model, optimizer, data, target_epsilon=7.5, delta=1 / (n // 8), steps=2,
            expected_batch_size=8, max_grad_norm=0.1, max_physical_batch_size=4,
            generator=torch.Generator().manual_seed(2),
        )  # fmt: skip

    def the_tutorials_loss(m, *batch):
        with pytest.raises(gradhooks.GradhooksError, match=r"loss"):
            private.backward(outputs(m, *batch)[0])

    run_checked(private, model, twin, ref_opt, 0.1, 8, losses_of, first=the_tutorials_loss)
    private.close()
    assert private.steps_taken == 2
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


# -- pytorch/opacus examples/mnist_lightning.py: make_private inside a LightningModule ----------


def lightning_classifier(L):
    """``mnist_lightning.py``'s ``LitSampleConvNetClassifier`` (its ``SampleConvNet`` in
    miniature) with gradhooks in the privacy engine's place: ``configure_optimizers`` makes the
    SGD optimizer and ``gradhooks.make_private`` over the training set (the script's
    ``make_private`` over the trainer's loader), whose Poisson batches are the training
    loader; ``training_step`` hands each example's loss to ``private.backward`` and steps
    (manual optimization: Lightning's own step would step the optimizer on the unclipped
    gradient); ``on_train_epoch_end`` logs ε."""

    class LitSampleConvNetClassifier(L.LightningModule):
        def __init__(self, data, record: list, sigma: float, clip: float):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 3, 4, 2, padding=1)
            self.conv2 = nn.Conv2d(3, 4, 2, 1)
            self.fc1, self.fc2 = nn.Linear(4 * 2 * 2, 6), nn.Linear(6, 3)
            self.automatic_optimization = False
            self.data, self.record, self.sigma, self.clip = data, record, sigma, clip
            self.epsilons: list[float] = []

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)  # [B, 3, 4, 4] from 10x10
            x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)  # [B, 4, 2, 2]
            return self.fc2(F.relu(self.fc1(x.view(-1, 4 * 2 * 2))))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0)
            self.private = gradhooks.make_private(
                self, optimizer, self.data, noise_multiplier=self.sigma, delta=1e-5, steps=3,
                expected_batch_size=4, max_grad_norm=self.clip,
                generator=torch.Generator().manual_seed(4),
            )  # fmt: skip
            return self.private.optimizer

        def train_dataloader(self):
            return self.private.batches()

        def training_step(self, batch, batch_idx):
            data, target = batch
            before = {n: p.detach().clone() for n, p in self.named_parameters()}
            state = self.private.optimizer.generator.get_state()
            loss = F.cross_entropy(self(data), target, reduction="none")
            self.private.backward(loss)
            assert self.private.step()
            self.record.append((before, state, (data.clone(), target.clone())))
            self.log("train_loss", loss.mean(), on_step=False, on_epoch=True, batch_size=len(data))

        def on_train_epoch_end(self):
            self.epsilons.append(self.private.epsilon)

    return LitSampleConvNetClassifier


def fit_lightning(L, module, precision: str = "64-true") -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision=precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        trainer.fit(module)


def lightning_data(dtype=D):
    g = torch.Generator().manual_seed(19)
    return torch.utils.data.TensorDataset(torch.randn(16, 1, 10, 10, generator=g, dtype=dtype),
                                          torch.randint(3, (16,), generator=g))  # fmt: skip


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
def test_opacus_mnist_lightning_make_private_in_configure_optimizers(precision):
    """pytorch/opacus ``examples/mnist_lightning.py``: the privacy engine set up in the
    module's ``configure_optimizers`` over the trainer's training loader, the wrapped model in
    ``training_step``, ε logged at each epoch's end, ``pl.Trainer(max_epochs=...)``. With
    ``gradhooks.make_private`` called in ``configure_optimizers`` on the module itself, its
    Poisson batches as ``train_dataloader`` and each batch taken inside the step
    (``training_step(self, dataloader_iter)``, the remedy the refusal of the read-ahead loop
    below names), under Lightning's ``Trainer`` in float64 (or ``precision="bf16-mixed"``,
    the forward under bfloat16 autocast, as the script's ``LightningCLI`` lets one set it): the
    3 steps are each the float64 loop's clipped sum plus the noise over the expected batch, at
    the parameters Lightning's loop reached (under bfloat16 within 3% of each parameter's
    clipped sum), and the ε logged is the accountant's."""
    L = pytest.importorskip("lightning")
    C, SIGMA, E = 1.0, 1.1, 4
    dtype = D if precision == "64-true" else torch.float32

    class ByIterator(lightning_classifier(L)):
        def training_step(self, dataloader_iter):
            batch, batch_idx, _ = next(dataloader_iter)
            return super().training_step(batch, batch_idx)

    record: list = []
    torch.manual_seed(0)
    module = ByIterator(lightning_data(dtype), record, SIGMA, C).to(dtype)
    twin = copy.deepcopy(module).to(D)
    fit_lightning(L, module, precision)
    assert len(record) == 3 and module.private.steps_taken == 3
    after = {n: p.detach().clone() for n, p in module.named_parameters()}
    module.private.close()
    for k, (before, state, (x, y)) in enumerate(record):
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(before[n])
        per = loop(twin, lambda a, b: F.cross_entropy(twin(a), b), x.to(D), y)
        want = clipped_sum(per, C)
        noise = torch.Generator().set_state(state)
        nxt = record[k + 1][0] if k + 1 < len(record) else after
        got = {n: (before[n] - nxt[n]).to(D) / 0.1 * E - SIGMA * C * torch.randn(
            before[n].shape, generator=noise, dtype=dtype).to(D) for n in want}  # fmt: skip
        if dtype == D:
            assert_all(got, want, f"step {k}", rtol=1e-8, atol=1e-10)
        else:
            for n in want:
                err = (got[n] - want[n]).norm() / want[n].norm()
                assert err < 3e-2, f"step {k}, {n}: relative error {err:.3g} under bfloat16"
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=SIGMA, sample_rate=E / 16, steps=3)
    assert module.epsilons == [pytest.approx(accountant.epsilon(1e-5), rel=1e-12)]


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.StateError,
    reason="Lightning's fit loop fetches the next batch before the training step of the one it "
    "has (a read-ahead of one); private.batches() refuses to give a batch while the last one "
    "has no backward and step, so that a batch left out is caught at once. Following a "
    "read-ahead would take a queue of the batches given and not stepped in PrivateTraining "
    "(with the end of the plan counted over them) and would catch a left-out batch one batch "
    "late; the error names the remedy (take the batch in training_step from dataloader_iter).",
)
def test_opacus_mnist_lightning_with_the_batch_given_to_training_step():
    """The same module with the script's ``training_step(self, batch, batch_idx)``: every batch
    gets its backward and its step, one batch after Lightning asked for the next."""
    L = pytest.importorskip("lightning")
    torch.manual_seed(0)
    module = lightning_classifier(L)(lightning_data(), [], 1.1, 1.0).to(D)
    try:
        fit_lightning(L, module)
    finally:
        module.private.close()
    assert module.private.steps_taken == 3


# -- rahafaljundi/Gradient-based-Sample-Selection: GSS-Greedy's per-sample gradient scores -------


class GSSGreedy(nn.Module):
    """``model/GSS_Greedy.py``'s ``Net`` in miniature: an MLP trained on each received batch
    (and on a batch replayed from the buffer), the batch kept when the memory is full, scored
    sample by sample (``get_each_batch_sample_sim``: one forward and backward per sample, the
    largest cosine similarity of its gradient with the gradients of ``memory_strength`` random
    buffer batches) and put into the buffer, or in place of buffer samples drawn by their
    scores. (``outcome.squeeze(1).byte()`` indexes as ``.bool()``: a uint8 mask no longer
    indexes in torch.)"""

    def __init__(self, net=None, n_memories: int = 3, buffer: int = 6, rn: int = 2,
                 sim_th: float = 2.0):  # fmt: skip
        super().__init__()
        self.net = net or nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.ce = nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(self.parameters(), 0.1)
        self.n_memories, self.n_sampled_memories, self.n_constraints = n_memories, buffer, 3
        self.rn, self.sim_th = rn, sim_th
        self.memory_data = None
        self.memory_labs = torch.zeros(n_memories, dtype=torch.long)
        self.sampled_memory_data = self.sampled_memory_labs = self.sampled_memory_cos = None
        self.grad_dims = [p.numel() for p in self.parameters()]
        self.mem_cnt, self.scores = 0, []

    def forward(self, x):
        return self.net(x)

    def grad_vector(self):
        return torch.cat([torch.zeros(p.numel(), dtype=D) if p.grad is None else p.grad.view(-1)
                          for p in self.parameters()])  # fmt: skip

    @staticmethod
    def cosine_similarity(x1, x2):
        return x1 @ x2.T / (x1.norm(dim=1, keepdim=True) * x2.norm(dim=1, keepdim=True).T)

    def train_step(self, x, y):
        self.zero_grad()
        self.ce(self(x), y).backward()
        self.opt.step()

    def observe(self, x, y):
        if self.memory_data is None:
            self.memory_data = torch.zeros(self.n_memories, *x.shape[1:], dtype=D)
        self.memory_data[self.mem_cnt : self.mem_cnt + len(y)] = x
        self.memory_labs[self.mem_cnt : self.mem_cnt + len(y)] = y
        self.mem_cnt += len(y)
        if self.sampled_memory_data is not None:
            shuffled = torch.randperm(self.sampled_memory_labs.size(0))
            effective = min(self.n_constraints, self.sampled_memory_labs.size(0))
        self.train_step(x, y)
        if self.sampled_memory_data is not None:
            idx = shuffled[:effective]
            self.train_step(self.sampled_memory_data[idx], self.sampled_memory_labs[idx])
        if self.mem_cnt < self.n_memories:
            return
        self.eval()
        if self.sampled_memory_data is not None and self.n_sampled_memories <= len(
            self.sampled_memory_data
        ):
            if self.get_batch_sim(effective) < self.sim_th:
                cos = self.sampled_memory_cos
                buffer_sim = (cos - cos.min()) / ((cos.max() - cos.min()) + 0.01)
                index = torch.multinomial(buffer_sim, len(x), replacement=False)
                item_sim = self.get_each_batch_sample_sim()
                weights = torch.cat(
                    [((item_sim + 1) / 2)[:, None], ((cos[index] + 1) / 2)[:, None]], 1
                )
                sub = torch.multinomial(weights, 1, replacement=False).squeeze(1).bool()
                added = torch.arange(len(item_sim))
                self.sampled_memory_data[index[sub]] = x[added[sub]].clone()
                self.sampled_memory_labs[index[sub]] = y[added[sub]].clone()
                self.sampled_memory_cos[index[sub]] = item_sim[added[sub]].clone()
        elif self.sampled_memory_data is None:
            self.sampled_memory_data = self.memory_data.clone()
            self.sampled_memory_labs = self.memory_labs.clone()
            self.sampled_memory_cos = torch.zeros(len(self.memory_data), dtype=D) + 0.1
        else:
            self.get_batch_sim(effective)
            cos = self.get_each_batch_sample_sim()
            self.sampled_memory_cos = torch.cat([self.sampled_memory_cos, cos.clone()])
            self.sampled_memory_data = torch.cat(
                [self.sampled_memory_data, self.memory_data.clone()]
            )
            self.sampled_memory_labs = torch.cat(
                [self.sampled_memory_labs, self.memory_labs.clone()]
            )
        self.mem_cnt = 0
        self.train()

    def get_batch_sim(self, effective):
        shuffled = torch.randperm(self.sampled_memory_labs.size(0))
        grads = []
        for b in range(self.rn):
            idx = shuffled[b * effective : (b + 1) * effective]
            self.zero_grad()
            self.ce(self(self.sampled_memory_data[idx]), self.sampled_memory_labs[idx]).backward()
            grads.append(self.grad_vector())
            if (b + 1) * effective >= self.sampled_memory_labs.size(0):
                break
        self.mem_grads = torch.stack(grads)
        self.zero_grad()
        self.ce(self(self.memory_data), self.memory_labs).backward()
        return self.cosine_similarity(self.mem_grads, self.grad_vector()[None]).max()

    def get_each_batch_sample_sim(self):
        """The script's loop: one backward per sample of the memory."""
        sims = []
        for x, y in zip(self.memory_data, self.memory_labs):
            self.zero_grad()
            self.ce(self(x[None]), y[None]).backward()
            sims.append(self.cosine_similarity(self.mem_grads, self.grad_vector()[None]).max())
        self.scores.append(torch.stack(sims))
        return self.scores[-1]


class GSSGreedyByGrad1(GSSGreedy):
    """The same, each sample's gradient taken from ``grad1`` of one backward of the memory
    (the model hooked once, at its construction)."""

    def __init__(self, net=None):
        super().__init__(net)
        self.hooks = gradhooks.add_hooks(self.net)

    def get_each_batch_sample_sim(self):
        self.zero_grad()
        self.ce(self(self.memory_data), self.memory_labs).backward()
        rows = torch.cat([p.grad1.flatten(1) for p in self.parameters()], 1)
        self.scores.append(self.cosine_similarity(rows, self.mem_grads).max(1).values)
        return self.scores[-1]


def test_gss_greedy_sample_scores_from_grad1_pick_the_same_buffer():
    """rahafaljundi/Gradient-based-Sample-Selection ``model/GSS_Greedy.py``: each received
    batch trains the MLP (and a replayed buffer batch), then its samples are scored by the
    largest cosine similarity of each sample's own gradient with buffer batches' gradients,
    one backward per sample, and enter the buffer or replace buffer samples drawn by their
    scores. With the scores from ``grad1`` of one backward of the whole memory, over 4
    received batches (the buffer filled by the second, samples replaced from the third on),
    every batch of scores is the loop's, and, from the same seed, the buffer, its scores and
    the weights are the script's own."""
    g = torch.Generator().manual_seed(20)
    batches = [(torch.randn(3, 4, generator=g, dtype=D), torch.randint(3, (3,), generator=g))
               for _ in range(4)]  # fmt: skip
    runs = []
    for kind in (GSSGreedy, GSSGreedyByGrad1):
        torch.manual_seed(0)
        model = kind().to(D)
        for x, y in batches:
            model.observe(x, y)
        runs.append(model)
    script, hooked = runs
    assert len(script.scores) == len(hooked.scores) == 3
    for k, (got, want) in enumerate(zip(hooked.scores, script.scores)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"scores {k}")
    assert torch.equal(hooked.sampled_memory_labs, script.sampled_memory_labs)
    torch.testing.assert_close(hooked.sampled_memory_data, script.sampled_memory_data)
    torch.testing.assert_close(hooked.sampled_memory_cos, script.sampled_memory_cos)
    assert_all(dict(hooked.named_parameters()), dict(script.named_parameters()), "the weights")
    hooked.hooks.remove()


# -- IST-DASLab/WoodFisher: the inverse empirical Fisher by Woodbury, one sample at a time ----


class WoodburryFisherPruner:
    """``policies/pruners.py``'s ``WoodburryFisherPruner`` (weights only) in miniature: the
    inverse of the damped empirical Fisher ``λI + (1/N) Σ g gᵀ`` built sample by sample by the
    Woodbury identity from each sample's masked weight gradient (``sample_grads``), the
    statistic ``w² / [F⁻¹]_qq`` of each weight, the weights below the sparsity's percentile
    pruned and the others moved by the OBS update ``F⁻¹ (-w_q / [F⁻¹]_qq) e_q``."""

    def __init__(self, model, damp: float = 1e-3):
        self.model, self.damp = model, damp
        self.modules = [m for m in model.modules() if hasattr(m, "weight_mask")]

    def fisher_inverse(self, sample_grads: torch.Tensor) -> torch.Tensor:
        goal = len(sample_grads)
        f_inv = None
        for g in sample_grads:
            if f_inv is None:
                f_inv = torch.outer(g, g).mul_(1 / self.damp**2).div_(goal + g.dot(g) / self.damp)
                f_inv.diagonal().sub_(1 / self.damp)
                f_inv.mul_(-1)
            else:
                cache = f_inv @ g
                cache.div_((goal + g.dot(cache)) ** 0.5)
                f_inv.sub_(torch.outer(cache, cache))
        return f_inv

    def prune(self, sample_grads: torch.Tensor, sparsity: float) -> None:
        f_inv = self.fisher_inverse(sample_grads)
        diag = f_inv.diagonal()
        stats, start = [], 0
        for m in self.modules:
            d = diag[start : start + m.weight.numel()].view_as(m.weight)
            stats.append(((m.weight.detach() ** 2) / (d + 1e-10) + 1e-10) * m.weight_mask)
            start += m.weight.numel()
        flat = torch.cat([s.flatten() for s in stats])
        threshold = torch.topk(flat, math.ceil(flat.numel() * (1 - sparsity)))[0][-1]
        old = [m.weight_mask for m in self.modules]
        for m, s in zip(self.modules, stats):
            m.weight_mask = (s > threshold).to(D)
        pruned = torch.cat([(o - m.weight_mask).flatten() for o, m in zip(old, self.modules)])
        weights = torch.cat([m.weight.detach().flatten() for m in self.modules])
        updates = f_inv @ (-pruned * weights / diag)
        start = 0
        for m, o in zip(self.modules, old):
            u = updates[start : start + m.weight.numel()].view_as(m.weight).clone()
            start += m.weight.numel()
            gone = o > m.weight_mask
            u[gone] = -m.weight.detach()[gone]
            with torch.no_grad():
                m.weight.add_(u)


def woodfisher_net() -> nn.Sequential:
    """The repository's ``MlpNet`` in miniature (log-softmax outputs, ``F.nll_loss``), each
    Linear with its ``weight_mask``."""
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3), nn.LogSoftmax(1)).to(D)
    for m in (net[0], net[2]):
        m.weight_mask = torch.ones_like(m.weight)
    return net


def test_woodfisher_inverse_from_grad1_prunes_as_the_per_sample_loop():
    """IST-DASLab/WoodFisher ``policies/pruners.py``'s ``WoodburryFisherPruner``: with
    ``fisher_mini_bsz=1`` its loader gives one sample at a time, each sample's gradient of
    ``F.nll_loss`` (``torch.autograd.grad``, masked by the weight masks) enters the Woodbury
    recursion of the inverse Fisher, and the pruner removes the weights of least statistic and
    moves the others (OBS), the model in eval mode. With the model hooked and the sample
    gradients ``grad1`` of one backward of the same samples (masked alike), two gradual
    pruning steps (sparsity 0.3, then 0.6, a masked SGD step on a batch between them) give the
    masks and weights of the script's loop, and each inverse is the loop's."""
    g = torch.Generator().manual_seed(21)
    x, y = torch.randn(8, 5, generator=g, dtype=D), torch.randint(3, (8,), generator=g)
    order = torch.randperm(8, generator=g)  # SubsetRandomSampler's order
    torch.manual_seed(0)
    nets = [woodfisher_net(), None]
    nets[1] = copy.deepcopy(nets[0])
    hooked, script = nets
    pruners = [WoodburryFisherPruner(n) for n in nets]

    def loop_grads(net):  # the script's loader of one sample
        rows = []
        for i in order:
            grads = torch.autograd.grad(F.nll_loss(net(x[i : i + 1]), y[i : i + 1]),
                                        [net[0].weight, net[2].weight])  # fmt: skip
            rows.append(torch.cat([(gr * m.weight_mask).flatten()
                                   for gr, m in zip(grads, (net[0], net[2]))]))  # fmt: skip
        return torch.stack(rows)

    with gradhooks.add_hooks(hooked) as h:
        for sparsity in (0.3, 0.6):
            for net in nets:
                net.eval()
            hooked.zero_grad()
            F.nll_loss(hooked(x[order]), y[order]).backward()
            rows = torch.cat([(m.weight.grad1 * m.weight_mask).flatten(1)
                              for m in (hooked[0], hooked[2])], 1)  # fmt: skip
            want = loop_grads(script)
            torch.testing.assert_close(rows, want, rtol=1e-10, atol=1e-13)
            torch.testing.assert_close(pruners[0].fisher_inverse(rows),
                                       pruners[1].fisher_inverse(want), rtol=1e-9, atol=1e-9)  # fmt: skip
            for pruner, sample_grads in zip(pruners, (rows, want)):
                pruner.prune(sample_grads, sparsity)
            for a, b in zip((hooked[0], hooked[2]), (script[0], script[2])):
                assert torch.equal(a.weight_mask, b.weight_mask)
            assert_all(dict(hooked.named_parameters()), dict(script.named_parameters()),
                       f"sparsity {sparsity}: the pruned weights", rtol=1e-8, atol=1e-10)  # fmt: skip
            kept = sum(int(m.weight_mask.sum()) for m in (hooked[0], hooked[2]))
            assert kept == math.ceil(48 * (1 - sparsity)) - 1  # (strictly above the k-th)
            for net in nets:  # a fine-tuning step, gradients masked
                net.train()
                net.zero_grad()
                F.nll_loss(net(x), y).backward()
                with torch.no_grad():
                    for p in net.parameters():
                        p -= 0.1 * p.grad
                    for m in (net[0], net[2]):
                        m.weight.mul_(m.weight_mask)
        h.clear()


# -- JinseongP/DPSAT: the ascent from the last privatized gradient, the step from the weights -----


class DPSAT:
    """``src/optim/minimizer.py``'s ``DPSAT``: ``ascent_step`` moves the weights by ``ρ`` along
    the last step's privatized gradient (normalized; none before the first step), and after
    the DP gradient at the moved weights, the weights are moved back, that gradient kept for
    the next ascent, and the optimizer steps. With gradhooks' ``DPOptimizer`` the move back is
    a step pre-hook of the wrapped optimizer: it runs once ``.grad`` holds the noised step's
    gradient and before the optimizer's step (the script's ``descent_step`` between Opacus'
    ``pre_step()`` and ``original_optimizer.step()``)."""

    def __init__(self, optimizer, model, rho: float):
        self.model, self.rho, self.prev, self.eps = model, rho, {}, {}
        optimizer.register_step_pre_hook(lambda *_: self.descent())

    @torch.no_grad()
    def ascent_step(self):
        params = list(self.model.parameters())
        prev = [self.prev.get(p, torch.zeros_like(p)) for p in params]
        norm = torch.norm(torch.stack([torch.norm(g) for g in prev]))
        norm = norm + 1e-16 if norm != 0 else torch.ones_like(norm)
        for p, g in zip(params, prev):
            self.eps[p] = g * (self.rho / norm)
            p.add_(self.eps[p])

    @torch.no_grad()
    def descent(self):
        for p in self.model.parameters():
            p.sub_(self.eps[p])
            self.prev[p] = p.grad.clone()


def test_dpsat_gradient_at_the_weights_moved_by_the_last_private_gradient():
    """JinseongP/DPSAT ``src/trainer/dptrainer.py``'s ``_update_weight`` with the ``DPSAT``
    minimizer over Opacus: ``minimizer.ascent_step()`` (the weights moved along the previous
    step's noised gradient, at no privacy cost), the cross-entropy at the moved weights
    backpropagated through the privacy engine, ``minimizer.descent_step()`` (the noised
    gradient, the weights moved back, SGD's step). With ``DPOptimizer`` over SGD and
    gradhooks' ``PoissonSampler``, for 5 steps (batches of 0 to 3 examples: the empty one a
    step on the noise alone) the gradient SGD steps on, the noise taken off, is the float64
    loop's clipped sum at the moved weights, and the weights are those of the script's update
    on that gradient from the weights before the move."""
    C, SIGMA, N, E, RHO = 1.0, 1.0, 12, 1.5, 0.05
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(22)
    x, y = torch.randn(N, 5, generator=g, dtype=D), torch.randint(3, (N,), generator=g)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.5, momentum=0.9)
    seen = []
    inner.register_step_pre_hook(lambda *_: seen.append(grads_of(model)))
    noise = torch.Generator().manual_seed(23)
    sampler = gradhooks.PoissonSampler(N, E, steps=5, generator=torch.Generator().manual_seed(24))
    sizes = []
    prev = None
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(inner, h, max_grad_norm=C, noise_multiplier=SIGMA,
                                   expected_batch_size=E, generator=noise)  # fmt: skip
        minimizer = DPSAT(inner, model, RHO)
        for step, idx in enumerate(sampler):
            state = noise.get_state()
            dp.zero_grad()
            minimizer.ascent_step()
            dp.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"))
            dp.step()  # the noised gradient, the weights moved back (pre-hook), SGD's step
            # the script's step on the twin, by the loop
            with torch.no_grad():
                params = list(twin.parameters())
                if prev is None:
                    moves = [torch.zeros_like(p) for p in params]
                else:
                    norm = torch.norm(torch.stack([torch.norm(t) for t in prev]))
                    moves = [t * (RHO / (norm + 1e-16)) for t in prev]
                for p, m in zip(params, moves):
                    p.add_(m)
            sizes.append(len(idx))
            if idx:
                per = loop(twin, lambda a, b: F.cross_entropy(twin(a), b), x[idx], y[idx])
                want = clipped_sum(per, C)
            else:  # (no example: the step's gradient is the noise alone)
                want = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
            again = torch.Generator().set_state(state)
            got = {n: t * E - SIGMA * C * torch.randn(t.shape, generator=again, dtype=D)
                   for n, t in seen[-1].items()}  # fmt: skip
            assert_all(got, want, f"step {step}: the clipped sum at the moved weights",
                       rtol=1e-9, atol=1e-11)  # fmt: skip
            with torch.no_grad():
                for p, m in zip(params, moves):
                    p.sub_(m)
            for n, p in twin.named_parameters():
                p.grad = seen[-1][n]
            prev = [seen[-1][n] for n, _ in twin.named_parameters()]
            ref_opt.step()
            assert_all(dict(model.named_parameters()), dict(twin.named_parameters()),
                       f"step {step}: the weights")  # fmt: skip
    assert len(seen) == 5 and 0 in sizes and max(sizes) > 1


# -- facebookresearch/DomainBed ANDMask: each environment's gradient from the examples' rows -----


def and_mask(tau, gradients, params):
    """``domainbed/algorithms.py``'s ``ANDMask.mask_grads``: each entry of the environments'
    mean gradient kept where at least ``τ`` of their signs agree, rescaled by the kept
    fraction."""
    for param, grads in zip(params, gradients):
        grads = torch.stack(grads, dim=0)
        mask = (torch.sign(grads).mean(0).abs() >= tau).to(torch.float32)
        param.grad = mask * grads.mean(0)
        param.grad *= 1.0 / (1e-10 + mask.sum() / mask.numel())


def test_domainbed_and_mask_environment_gradients_as_means_of_grad1_rows():
    """facebookresearch/DomainBed ``domainbed/algorithms.py``'s ``ANDMask.update``: one
    forward and one ``autograd.grad`` per environment, the environments' gradients masked by
    the agreement of their signs (``τ``) and averaged into ``.grad``, Adam's step. With the
    network hooked, one forward and backward of the environments' examples together, each
    environment's gradient the mean of its examples' ``grad1`` rows (each environment's loss
    a mean over its own examples): over 3 steps the environments' gradients are the loop's,
    some entries are masked out, and the masked gradient and the weights are the script's."""
    TAU = 0.8
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                            nn.Linear(8, 3)).to(D)  # fmt: skip
    twin = copy.deepcopy(network)
    opt = torch.optim.Adam(network.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(25)
    sizes = [3, 2, 4]  # environments of unequal sizes
    with gradhooks.add_hooks(network):
        for step in range(3):
            minibatches = [(torch.randn(n, 4, generator=g, dtype=D) + e,
                            torch.randint(3, (n,), generator=g)) for e, n in enumerate(sizes)]  # fmt: skip
            # the script's loop, on the twin
            want = [[] for _ in twin.parameters()]
            for x, y in minibatches:
                env_grads = torch.autograd.grad(
                    F.cross_entropy(twin(x), y), list(twin.parameters())
                )
                for grads, eg in zip(want, env_grads):
                    grads.append(eg)
            ref_opt.zero_grad()
            and_mask(TAU, want, list(twin.parameters()))
            ref_opt.step()
            # one forward and backward of every environment's examples
            all_x = torch.cat([x for x, _ in minibatches])
            all_y = torch.cat([y for _, y in minibatches])
            opt.zero_grad()
            F.cross_entropy(network(all_x), all_y).backward()
            got = [[rows.mean(0) for rows in p.grad1.split(sizes)] for p in network.parameters()]
            for k, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=1e-10, atol=1e-13,
                                           msg=f"step {step}: parameter {k}")  # fmt: skip
            opt.zero_grad()
            and_mask(TAU, got, list(network.parameters()))
            masked = [p.grad.clone() for p in network.parameters()]
            assert any(bool((m == 0).any()) for m in masked)
            for m, p in zip(masked, twin.parameters()):
                torch.testing.assert_close(m, p.grad, rtol=1e-9, atol=1e-12)
            opt.step()
            assert_all(dict(network.named_parameters()), dict(twin.named_parameters()),
                       f"step {step}: the weights")  # fmt: skip


# -- EleutherAI/gpt-neox: the gradient noise scale, B_small of one example ----------------------


def ema(avg, beta, yi, i):
    """``megatron/gradient_noise_scale/gradient_noise_scale.py``'s ``ema``: the running
    average and its bias-corrected value."""
    avg = beta * (0 if avg is None else avg) + (1 - beta) * yi
    return avg, avg / (1 - beta ** (i + 1))


class GradientNoiseScale:
    """gpt-neox's ``GradientNoiseScale._update`` given ``|G_small|²`` and ``|G_big|²``: the
    unbiased estimates of ``|G|²`` (the script's ``noise``) and ``tr(Σ)`` (its ``scale``),
    their bias-corrected running averages, and ``B_simple = scale / noise``."""

    def __init__(self, small: int, big: int, beta: float = 0.99):
        self.small, self.big, self.beta = small, big, beta
        self.ema_noise = self.ema_scale = self.noise_scale = None
        self.n_updates = 0

    def update(self, g_small: float, g_big: float) -> None:
        noise = (self.big * g_big - self.small * g_small) / (self.big - self.small)
        scale = (g_small - g_big) / (1 / self.small - 1 / self.big)
        self.ema_noise, noise = ema(self.ema_noise, self.beta, noise, self.n_updates)
        self.ema_scale, scale = ema(self.ema_scale, self.beta, scale, self.n_updates)
        self.noise_scale = scale / noise
        self.n_updates += 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
def test_gpt_neox_gradient_noise_scale_with_per_example_norms_as_the_small_batch(dtype):
    """EleutherAI/gpt-neox ``megatron/gradient_noise_scale/gradient_noise_scale.py``: McCandlish
    et al.'s ``B_simple`` from the squared norms of a small batch's gradient and a big one's
    (the script: one micro-batch, and ``n_batches`` of them averaged), each estimate
    bias-corrected and averaged over updates (``beta=0.99``). With the model hooked for
    ``norms``, the small batches are the examples themselves: ``|G_small|²`` the mean of the
    squared per-example norms (``h.norms()``), ``|G_big|²`` that of the batch's gradient,
    ``B_small = 1``, ``B_big`` the batch. On Hugging Face's ``GPTNeoXForCausalLM`` (the
    library's model, rotary and parallel residual) trained by AdamW over 3 steps, the norms
    are the float64 loop's (within bfloat16's rounding under ``torch.autocast``, where the
    batch's gradient is torch's own in float32), and in float64 the noise scale is the one of
    the loop's norms."""
    config = hf("GPTNeoXConfig")(
        hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16,
        vocab_size=20, max_position_embeddings=16, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    param_dtype = D if dtype == D else torch.float32
    model = hf("GPTNeoXForCausalLM")(config).to(param_dtype)
    twin = copy.deepcopy(model).to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    B = 4
    ours, theirs = GradientNoiseScale(1, B), GradientNoiseScale(1, B)
    g = torch.Generator().manual_seed(26)

    def loss_of(m, ids):
        return m(input_ids=ids, labels=ids).loss

    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(3):
            ids = torch.randint(20, (B, 6), generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != D):
                loss = loss_of(model, ids)
            loss.backward()
            norms = h.norms().to(D)
            g_big = sum(p.grad.to(D).pow(2).sum() for p in model.parameters())
            ours.update(float(norms.pow(2).mean()), float(g_big))
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)
            per = flat(loop(twin, lambda i: loss_of(twin, i), ids))
            want_big = per.mean(0).pow(2).sum()
            theirs.update(float(per.norm(dim=1).pow(2).mean()), float(want_big))
            if dtype == D:
                torch.testing.assert_close(norms, per.norm(dim=1), rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(g_big, want_big, rtol=1e-10, atol=1e-12)
                assert ours.noise_scale == pytest.approx(theirs.noise_scale, rel=1e-8)
            else:
                torch.testing.assert_close(norms, per.norm(dim=1), rtol=3e-2, atol=1e-3)
                torch.testing.assert_close(g_big, want_big, rtol=3e-2, atol=1e-3)
            opt.step()


def test_a_batch_asked_for_before_the_last_ones_step_is_refused_naming_the_read_ahead():
    """What the read-ahead above meets, without Lightning: the next batch of
    ``private.batches()`` asked for before the last one's backward and step is refused
    (``StateError``), the message naming a loop that reads ahead and the remedy, and nothing
    was stepped."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(D)
    before = copy.deepcopy(model.state_dict())
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, dtype=D), torch.randint(3, (16,)))
    private = gradhooks.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                     noise_multiplier=1.0, delta=1e-5, steps=2,
                                     expected_batch_size=4, max_grad_norm=1.0)  # fmt: skip
    batches = private.batches()
    next(batches)
    with pytest.raises(gradhooks.StateError, match="reads a batch ahead.*dataloader_iter"):
        next(batches)
    private.close()
    assert private.steps_taken == 0
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


class TinyResNet18(nn.Module):
    """GSS' ``model/common.py`` ``ResNet18`` (the CIFAR-10 runs) in miniature: a stem and one
    ``BasicBlock``, each convolution followed by batch norm, and a linear head."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b_conv1, self.b_bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b_conv2, self.b_bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.linear = nn.Linear(4, classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(out + self.b_bn2(self.b_conv2(F.relu(self.b_bn1(self.b_conv1(out))))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


class GSSGreedyTrainingPaused(GSSGreedyByGrad1):
    """The hooked model's training steps under ``hooks.paused()``: their batch norms normalize
    with the batch's statistics, and they need no per-example gradient."""

    def train_step(self, x, y):
        with self.hooks.paused():
            super().train_step(x, y)


def test_gss_greedy_on_a_batch_norm_resnet_scores_in_eval_mode_training_paused():
    """GSS-Greedy as its CIFAR-10 runs use it, on ``ResNet18`` with batch norm: the training
    steps in train mode, the scoring after ``self.eval()``. Hooked once at construction, the
    first training step is refused at the first batch norm (``MixedExamplesError``), the
    message naming ``hooks.paused()`` for a step that needs no per-example gradient, and the
    model is left as it was; with the training steps under ``hooks.paused()`` the scores (in
    eval mode, from ``grad1``), the buffer, the weights and the running statistics over 4
    received batches are the script's own, from the same seed."""
    g = torch.Generator().manual_seed(27)
    batches = [(torch.randn(3, 3, 4, 4, generator=g, dtype=D), torch.randint(3, (3,), generator=g))
               for _ in range(4)]  # fmt: skip
    torch.manual_seed(0)
    refused = GSSGreedyByGrad1(TinyResNet18()).to(D)
    before = model_state(refused)
    stats = {n: b.clone() for n, b in refused.named_buffers()}
    with pytest.raises(gradhooks.MixedExamplesError, match=r"hooks\.paused\(\).*training step"):
        refused.observe(*batches[0])
    assert_untouched(refused, before)
    assert all(torch.equal(stats[n], b) for n, b in refused.named_buffers())
    refused.hooks.remove()
    runs = []
    for kind in (GSSGreedy, GSSGreedyTrainingPaused):
        torch.manual_seed(0)
        model = kind(TinyResNet18()).to(D)
        for x, y in batches:
            model.observe(x, y)
        runs.append(model)
    script, hooked = runs
    assert len(hooked.scores) == len(script.scores) == 3
    for k, (got, want) in enumerate(zip(hooked.scores, script.scores)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"scores {k}")
    assert torch.equal(hooked.sampled_memory_labs, script.sampled_memory_labs)
    torch.testing.assert_close(hooked.sampled_memory_cos, script.sampled_memory_cos)
    assert_all(dict(hooked.named_parameters()), dict(script.named_parameters()), "the weights")
    assert_all(dict(hooked.named_buffers()), dict(script.named_buffers()), "the running stats")
    hooked.hooks.remove()

"""Training-loop idioms, a sixteenth set: how learning paradigms compose a training step.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a step that another paradigm composes around the training backward, in forms the earlier
sets do not train. Adversarial: MART's misclassification-aware loss after a PGD attack in eval
mode; an attack run with the parameters frozen by ``requires_grad_(False)``; adversarial weight
perturbation (AWP) of TRADES, the weights moved in place by a proxy's step before the training
backward and put back after the optimizer's step; Jacobian regularization by random
projections, in the training backward (refused) and in a backward of its own under
``h.paused()``. Meta-learning: Reptile, its inner steps on the hooked model or on a deep copy
and the meta-update interpolated in place; ANIL, only the head adapted by
``torch.func.functional_call`` on the head submodule itself; a hypernetwork shifting a head's
weight by ``functional_call`` inside the forward; learn2learn's ``clone_module``
(refused, naming the layer) and the same MAML step by ``functional_call``; "learning to
reweight", the examples' weights from a meta step through the hooked model. Teacher-student and
semi-supervised: FitNets' hint through a connector trained beside the student, with a frozen
teacher's soft targets; temporal ensembling's per-example targets kept from earlier epochs,
with a ramped-up weight; FixMatch's labelled and unlabelled batches in two forwards of different
sizes (refused). Loss shaping: co-teaching, two hooked networks each trained on the examples its
peer finds easy; uncertainty-weighted task losses with learned log-variances, in the loss
(warned, and refused by the DP step), in a module given each example's losses, or given their
batch means (refused). Each is compared with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`, or a loop written out where the example's loss
runs through an adaptation), or checked to stop with a typed error that names what went
wrong."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1
from harness import labelled_batch as batch
from harness import wide_mlp as mlp

D = torch.float64
STEPS = 3


def weighted(want: dict, w: torch.Tensor) -> dict:
    """Each example's row of ``want`` times its weight ``w[i]``."""
    return {n: w.view(-1, *[1] * (g.dim() - 1)) * g for n, g in want.items()}


def prefixed(want: dict, prefix: str) -> dict:
    """The loop's rows of a wrapper's parameters under the wrapped model's names."""
    return {n.removeprefix(prefix): g for n, g in want.items()}


def renamed(want: dict, names: dict) -> dict:
    """The loop's rows under other names: each name's first part, ``names[part]``."""
    return {names[n.split(".", 1)[0]] + "." + n.split(".", 1)[1]: g for n, g in want.items()}


class Twice(nn.Module):
    """The model run on two batches of the same examples (clean and adversarial)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x, xa):
        return self.m(x), self.m(xa)


def rows_through(params: dict, loss_of, n: int, *args) -> dict:
    """The float64 loop written out: example ``i``'s gradient of ``loss_of(i, *args)`` (its
    loss, whatever runs before it) with respect to each tensor of ``params``, under pause."""
    rows: dict[str, list] = {k: [] for k in params}
    with gradhooks.paused():
        for i in range(n):
            grads = torch.autograd.grad(loss_of(i, *args), list(params.values()))
            for k, g in zip(params, grads):
                rows[k].append(g)
    return {k: torch.stack(r) for k, r in rows.items()}


# -- adversarial training --------------------------------------------------------------------


def mart_rows(outs, y, beta: float = 6.0):
    """MART's loss per example (Wang et al. 2020, YisenWang/MART, ``mart.py``): the boosted
    cross-entropy of the adversarial prediction (its cross-entropy and a margin term against
    the likeliest wrong class), plus ``beta`` times the KL from the clean prediction to the
    adversarial one weighted by ``1 - p_y`` of the clean prediction (not detached)."""
    clean, adv = outs
    p_adv = F.softmax(adv, 1)
    top = torch.argsort(p_adv, 1)[:, -2:]
    wrong = torch.where(top[:, -1] == y, top[:, -2], top[:, -1])
    boosted = F.cross_entropy(adv, y, reduction="none") + F.nll_loss(
        torch.log(1.0001 - p_adv + 1e-12), wrong, reduction="none"
    )
    p_clean = F.softmax(clean, 1)
    true = p_clean.gather(1, y.unsqueeze(1)).squeeze(1)
    kl = F.kl_div(torch.log(p_adv + 1e-12), p_clean, reduction="none").sum(1)
    return boosted + beta * kl * (1.0000001 - true)


def test_mart_loss_after_a_pgd_attack_in_eval_mode():
    """MART: a PGD attack by ``torch.autograd.grad`` on the input in eval mode, with the hooks
    on, then a loss whose every term couples only an example's clean and adversarial rows
    (a weight ``1 - p_y`` of its own clean prediction, with its gradient): grad1 is each
    example's gradient through both forwards, never the attack's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            model.eval()
            xa = (x + 0.001 * torch.randn_like(x)).requires_grad_(True)
            for _ in range(2):
                (gx,) = torch.autograd.grad(F.cross_entropy(model(xa), y), xa)
                xa = (xa + 0.05 * gx.sign()).detach().requires_grad_(True)
            xa = xa.detach()
            model.train()
            opt.zero_grad()
            mart_rows((model(x), model(xa)), y).mean().backward()
            want = loop_grad(Twice(model), lambda o, t: mart_rows(o, t).sum(), (x, xa), y)
            assert_grad1(model, prefixed(want, "m."), f"step {step}")
            opt.step()


def test_an_attack_run_with_the_parameters_frozen_then_the_training_step():
    """Robustness libraries freeze the model for the attack (``requires_grad_(False)``), run
    ``loss.backward()`` onto ``x_adv.grad`` and unfreeze it for the training step: the hooks
    are planned again at each change, the attack's backwards write nothing, and grad1 is the
    adversarial batch's own."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            model.requires_grad_(False)
            xa = x.clone().requires_grad_(True)
            for _ in range(2):
                F.cross_entropy(model(xa), y).backward()
                with torch.no_grad():
                    xa += 0.05 * xa.grad.sign()
                xa.grad = None
            for n, p in model.named_parameters():
                assert p.grad is None, n
            model.requires_grad_(True)
            xa = xa.detach()
            F.cross_entropy(model(xa), y).backward()
            want = loop_grad(model, F.cross_entropy, xa, y)
            assert_grad1(model, want, f"step {step}")
            norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
            assert_close(h.norms(), norms, f"step {step}: norms")
            opt.step()


class Thrice(nn.Module):
    """TRADES as AWP's script writes it: the model run on the adversarial batch and twice on
    the clean one (the KL's target, not detached, and the cross-entropy's logits)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x, xa):
        return self.m(xa), self.m(x), self.m(x)


def trades_awp_loss(outs, y, beta: float = 6.0):
    adv, target, clean = outs
    kl = F.kl_div(F.log_softmax(adv, 1), F.softmax(target, 1), reduction="batchmean")
    return F.cross_entropy(clean, y) + beta * kl


def test_adversarial_weight_perturbation_moves_the_weights_in_place_around_the_step():
    """AWP (Wu et al. 2020, csdongxian/AWP, ``trades_AWP/train_trades_cifar.py`` and its
    ``TradesAWP``): a proxy model loaded with the weights takes one ascent step on TRADES' loss,
    each weight matrix is moved in place by ``gamma * ||w||`` along the proxy's change, the
    training backward runs there (the clean batch through the model twice), the optimizer
    steps, and the move is subtracted again. grad1 is each example's gradient at the moved
    weights."""
    model, proxy = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    proxy_opt = torch.optim.SGD(proxy.parameters(), lr=0.1)
    gamma = 0.05
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            xa = x + 0.05 * torch.randn_like(x)
            proxy.load_state_dict(model.state_dict())
            proxy_opt.zero_grad()
            (-trades_awp_loss(Thrice(proxy)(x, xa), y)).backward()
            proxy_opt.step()
            moves = {}
            with torch.no_grad():
                for (n, w), q in zip(model.named_parameters(), proxy.parameters()):
                    if w.dim() > 1:
                        change = q - w
                        moves[n] = gamma * w.norm() * change / (change.norm() + 1e-20)
                        w.add_(moves[n])
            opt.zero_grad()
            trades_awp_loss(Thrice(model)(x, xa), y).backward()
            want = loop_grad(Thrice(model), trades_awp_loss, (x, xa), y)
            assert_grad1(model, prefixed(want, "m."), f"step {step}")
            opt.step()
            with torch.no_grad():
                for n, w in model.named_parameters():
                    if n in moves:
                        w.sub_(moves[n])


def jacobian_penalty(out: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hoffman et al.'s Jacobian regularizer (facebookresearch/jacobian_regularizer,
    ``jacobian/jacobian.py``) with one random projection: ``C * ||v^T J||^2 / batch`` with
    ``v^T J`` from ``torch.autograd.grad(out, x, v, create_graph=True)``."""
    (vj,) = torch.autograd.grad(out, x, v, create_graph=True)
    return out.shape[1] * vj.pow(2).sum() / x.shape[0]


def projections(step: int) -> torch.Tensor:
    v = torch.randn(5, 2, dtype=D, generator=torch.Generator().manual_seed(100 + step))
    return v / v.norm(dim=1, keepdim=True)


def test_jacobian_regularization_in_the_training_backward_is_refused_leaving_the_model():
    """The regularizer added to the loss and backpropagated with it: its terms through the
    double backward have per-example gradients the hooks do not see. Refused
    (``UnsupportedError`` naming a layer, pointing to ``torch.func``), with no grad1 written
    and ``.grad`` as it was (``None``)."""
    model = mlp()
    x, y = batch(0)
    x.requires_grad_(True)
    with gradhooks.add_hooks(model):
        out = model(x)
        loss = F.cross_entropy(out, y) + 0.1 * jacobian_penalty(out, x, projections(0))
        with pytest.raises(gradhooks.UnsupportedError, match=r"'\d' \(Linear\).*torch\.func"):
            loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is None and not hasattr(p, "grad1"), n


def test_jacobian_regularization_backpropagated_under_pause_after_the_loss():
    """The documented way round: the cross-entropy's backward captured (``retain_graph``),
    then the regularizer's under ``h.paused()``. grad1 is each example's cross-entropy
    gradient; ``.grad`` holds both, as without hooks."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(STEPS):
            x, y = batch(step)
            x.requires_grad_(True)
            v = projections(step)
            ref_opt.zero_grad()
            out = ref(x)
            (F.cross_entropy(out, y) + 0.1 * jacobian_penalty(out, x, v)).backward()
            opt.zero_grad()
            out = model(x)
            F.cross_entropy(out, y).backward(retain_graph=True)
            penalty = 0.1 * jacobian_penalty(out, x, v)
            with h.paused():
                penalty.backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x.detach(), y), f"step {step}")
            for (n, p), r in zip(model.named_parameters(), ref.parameters()):
                assert_close(p.grad, r.grad, f"step {step}: .grad of {n}")
            opt.step()
            ref_opt.step()


# -- meta-learning -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["the hooked model", "a deep copy"])
def test_reptile_inner_steps_then_the_interpolation_in_place(where):
    """Reptile (Nichol et al., openai/supervised-reptile, ``supervised_reptile/reptile.py``):
    a few SGD steps on one task's batches, then the weights moved in place a fraction of the
    way from where they started to where the steps took them. On the hooked model, every inner
    step's grad1 is its own batch's; on a deep copy (inert hooks: the copy gets no grad1), the
    hooked model's next captured step after the interpolation is its batch's own."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for it in range(2):
            start = [p.detach().clone() for p in model.parameters()]
            learner = model if where == "the hooked model" else copy.deepcopy(model)
            inner = opt if learner is model else torch.optim.SGD(learner.parameters(), lr=0.1)
            for k in range(STEPS):
                x, y = batch(10 * it + k)
                inner.zero_grad()
                F.cross_entropy(learner(x), y).backward()
                if learner is model:
                    want = loop_grad(model, F.cross_entropy, x, y)
                    assert_grad1(model, want, f"iteration {it}, inner step {k}")
                else:
                    assert not any(hasattr(p, "grad1") for p in learner.parameters())
                inner.step()
            with torch.no_grad():
                for p, s, q in zip(model.parameters(), start, learner.parameters()):
                    p.copy_(s + 0.5 * (q - s))
            x, y = batch(100 + it)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"iteration {it}: after")


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize(
    "order, inner", [("first", "captured"), ("first", "paused"), ("second", "paused")]
)
def test_anil_adapts_the_head_alone_by_functional_call_on_the_head(order, inner):
    """ANIL (Raghu et al.): the body's features computed once per set (``model.body(x)``),
    the head adapted on the support features and called on the query's with its fast weights
    by ``functional_call(model.head, fast, ...)``, a submodule called on its own. grad1 is each
    query example's gradient through the adaptation, the body's and the head's. Before, the
    hooks planned again at the head's call missed that call: the head's grad1 was twice the
    gradient (refused by the check at its backwards, wrong in silence at the others)."""
    model = Body().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    own = dict(model.named_parameters())

    def query_logits(h, sx, sy, qx):
        with h.paused() if inner == "paused" else torch.enable_grad():
            head = dict(model.head.named_parameters())
            loss = F.cross_entropy(model.head(model.body(sx)), sy)
            g = torch.autograd.grad(loss, list(head.values()), create_graph=order == "second")
        fast = {n: p - 0.5 * gi for (n, p), gi in zip(head.items(), g)}
        return functional_call(model.head, fast, (model.body(qx),))

    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(STEPS):
            sx, sy = batch(10 + step, n=4)
            qx, qy = batch(step)
            want = rows_through(
                own,
                lambda i, sx, sy, qx, qy: F.cross_entropy(
                    query_logits(h, sx, sy, qx[i : i + 1]), qy[i : i + 1]
                ),
                5, sx, sy, qx, qy,
            )  # fmt: skip
            opt.zero_grad()
            F.cross_entropy(query_logits(h, sx, sy, qx), qy, reduction="sum").backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_anil_second_order_with_the_inner_step_captured_says_to_pause_it():
    """The same second-order step with its inner step captured (support and query of one
    size): the outer backward runs through a call an earlier ``create_graph=True`` backward
    went through, and is refused (``UnsupportedError``) naming the layer and saying to run
    the inner step under ``h.paused()``, which the test above shows gives the loop's grad1;
    nothing is written."""
    model = Body().to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (sx, sy), (qx, qy) = batch(10), batch(0)
        head = dict(model.head.named_parameters())
        loss = F.cross_entropy(model.head(model.body(sx)), sy)
        g = torch.autograd.grad(loss, list(head.values()), create_graph=True)
        fast = {n: p - 0.5 * gi for (n, p), gi in zip(head.items(), g)}
        out = functional_call(model.head, fast, (model.body(qx),))
        with pytest.raises(gradhooks.UnsupportedError, match=r"inner step.*h\.paused\(\)"):
            F.cross_entropy(out, qy, reduction="sum").backward()
    for n, p in model.named_parameters():
        assert p.grad is None and not hasattr(p, "grad1"), n


class TaskConditioned(nn.Module):
    """A head whose weight a hypernetwork shifts by a task's code (CAVIA- and FiLM-like
    conditioning of meta-learning), inside the forward: ``functional_call`` on the head with
    ``weight + 0.1 * delta(code)``, the code looked up in a table of one task."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)
        self.delta = nn.Linear(4, 12)
        self.codes = nn.Embedding(1, 4)

    def forward(self, x):
        shift = self.delta(self.codes(torch.zeros(1, dtype=torch.long))).view(2, 6)
        fast = {"weight": self.head.weight + 0.1 * shift, "bias": self.head.bias}
        return functional_call(self.head, fast, (self.body(x),))


def test_a_hypernetwork_shifts_a_heads_weight_by_functional_call_inside_the_forward():
    """The shifted weight is a tensor computed from the head's weight and the hypernetwork's
    parameters (shared by every example), put in the head's slot for one call inside the
    model's forward: grad1 of the head, the hypernetwork and the task code is each example's
    gradient through the shift."""
    torch.manual_seed(0)
    model = TaskConditioned().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()


def clone_module(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """learn2learn's ``clone_module`` (learnables/learn2learn, ``learn2learn/utils``), in
    short: a new object of the module's type sharing its ``__dict__`` (and so its hooks), with
    each parameter slot holding ``p.clone()``, recursively."""
    memo = {} if memo is None else memo
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = {
        k: None if p is None else memo.setdefault(id(p), p.clone())
        for k, p in module._parameters.items()
    }
    clone._modules = {k: clone_module(m, memo) for k, m in module._modules.items()}
    return clone


def update_module(module: nn.Module, updates: dict) -> nn.Module:
    """learn2learn's ``update_module``: each slot's tensor ``p`` replaced by ``p + u``."""
    for k, p in module._parameters.items():
        if p is not None:
            module._parameters[k] = p + updates[id(p)]
    for m in module._modules.values():
        update_module(m, updates)
    return module


def test_learn2learn_clone_module_is_refused_and_functional_call_does_the_same_step():
    """learn2learn's MAML adapts a clone: ``clone_module`` makes a new module object that
    shares the hooked module's hooks, its slots holding ``p.clone()``. The hooks, planned for
    the hooked modules, do not capture the clone's calls: before, the parameters got ``.grad``
    without grad1 and a warning at the backward whose causes did not fit. The clone's first
    call is refused (``UnsupportedError``) naming the layer and the parameter, with nothing
    written; run under ``h.paused()`` it works; and the same second-order step written with
    ``functional_call`` on the hooked model, as the message advises, gives each query
    example's gradient through the adaptation."""
    model = mlp()
    own = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fast_weights(sx, sy) -> dict:
        with gradhooks.paused():  # (the inner step: the support batch's, not captured)
            loss = F.cross_entropy(functional_call(model, own, (sx,)), sy)
            g = torch.autograd.grad(loss, list(own.values()), create_graph=True)
        return {n: t - 0.3 * gi for (n, t), gi in zip(own.items(), g)}

    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(STEPS):
            sx, sy = batch(10 + step, n=4)
            qx, qy = batch(step)
            opt.zero_grad()
            learner = clone_module(model)
            with pytest.raises(gradhooks.UnsupportedError, match=r"'0' \(Linear\).*'0\.weight'"):
                learner(sx)
            with h.paused():
                ps = list(learner.parameters())
                g = torch.autograd.grad(F.cross_entropy(learner(sx), sy), ps)
                update_module(learner, {id(p): -0.3 * gi for p, gi in zip(ps, g)})
                assert learner(qx).shape == (5, 2)
            for n, p in model.named_parameters():
                assert p.grad is None, n
            want = rows_through(
                own,
                lambda i, sx, sy, qx, qy: F.cross_entropy(
                    functional_call(model, fast_weights(sx, sy), (qx[i : i + 1],)), qy[i : i + 1]
                ),
                5, sx, sy, qx, qy,
            )  # fmt: skip
            logits = functional_call(model, fast_weights(sx, sy), (qx,))
            F.cross_entropy(logits, qy, reduction="sum").backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_learning_to_reweight_by_a_meta_step_through_the_hooked_model():
    """Learning to reweight (Ren et al. 2018, uber-research/learning-to-reweight-examples):
    each example's loss weighted by ``eps_i = 0``, one differentiable SGD step
    (``torch.autograd.grad(..., create_graph=True)`` through the hooked model, captured),
    the validation loss at the fast weights by ``functional_call``, its gradient with respect
    to ``eps`` alone; the weights ``max(-grad, 0)`` normalized, then the weighted loss's
    backward after ``zero_grad``. grad1 is ``w_i`` times each example's gradient."""
    model = mlp()
    own = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(STEPS):
            x, y = batch(step, n=6)
            vx, vy = batch(100 + step, n=4)
            eps = torch.zeros(6, dtype=D, requires_grad=True)
            cost = F.cross_entropy(model(x), y, reduction="none")
            g = torch.autograd.grad((eps * cost).sum(), list(own.values()), create_graph=True)
            fast = {n: p - 0.1 * gi for (n, p), gi in zip(own.items(), g)}
            (ge,) = torch.autograd.grad(
                F.cross_entropy(functional_call(model, fast, (vx,)), vy), eps
            )
            w = ge.neg().clamp(min=0)
            w = (w / w.sum() if w.sum() > 0 else w).detach()
            opt.zero_grad()
            (w * F.cross_entropy(model(x), y, reduction="none")).sum().backward()
            want = weighted(loop_grad(model, F.cross_entropy, x, y), w)
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- teacher and student, semi-supervised ------------------------------------------------------


class Student(nn.Module):
    """A network that returns its features on request, as RepDistiller's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.fc = nn.Linear(6, 2)

    def forward(self, x, is_feat: bool = False):
        f = self.features(x)
        out = self.fc(f)
        return ([f], out) if is_feat else out


class WithConnector(nn.Module):
    """The student and the hint's connector as one model, for the loop."""

    def __init__(self, student: nn.Module, connector: nn.Module) -> None:
        super().__init__()
        self.s, self.c = student, connector

    def forward(self, x):
        feats, out = self.s(x, is_feat=True)
        return out, self.c(feats[0])


def hint_and_kd(outs, target):
    """Cross-entropy, Hinton's KD at temperature 4, FitNets' hint (an MSE to the teacher's
    features through the connector); ``target`` holds the label, the teacher's features and
    its logits, per example."""
    out, hint = outs
    y, t_feat, t_logits = target[:, 0].long(), target[:, 1:7], target[:, 7:]
    kd = F.kl_div(F.log_softmax(out / 4, 1), F.softmax(t_logits / 4, 1), reduction="batchmean")
    return F.cross_entropy(out, y) + 0.9 * 16 * kd + 10 * F.mse_loss(hint, t_feat)


@pytest.mark.parametrize("container", ["held", "made in the call"])
def test_fitnets_hint_through_a_connector_trained_beside_the_student(container):
    """RepDistiller (HobbitLong/RepDistiller, ``train_student.py``, ``distiller_zoo/FitNet.py``):
    the student returns its features (``is_feat=True``), a connector (``ConvReg``, here a
    Linear) called by the loop maps them to the teacher's, and the loss adds the hint to the
    cross-entropy and the frozen teacher's KD; the student and the connector are trained
    together, hooked as one ``nn.ModuleList`` (RepDistiller's ``trainable_list``), held by the
    loop or made in the call to ``add_hooks`` and held by nothing else (the garbage collector
    takes it). grad1 of both is each example's gradient. Before, the container made in the
    call, collected, failed the next forward with an ``AttributeError`` of ``None``."""
    torch.manual_seed(0)
    student, teacher, connector = Student().to(D), Student().to(D), nn.Linear(6, 6).to(D)
    teacher.eval().requires_grad_(False)
    trainable = nn.ModuleList([student, connector])
    opt = torch.optim.SGD(trainable.parameters(), lr=0.05, momentum=0.9)
    hooked = trainable if container == "held" else nn.ModuleList([student, connector])
    with gradhooks.add_hooks(hooked):
        del hooked
        gc.collect()
        for step in range(STEPS):
            x, y = batch(step)
            with torch.no_grad():
                t_feats, t_logits = teacher(x, is_feat=True)
            target = torch.cat([y[:, None].to(D), t_feats[0], t_logits], 1)
            opt.zero_grad()
            feats, out = student(x, is_feat=True)
            hint_and_kd((out, connector(feats[0])), target).backward()
            want = loop_grad(WithConnector(student, connector), hint_and_kd, x, target)
            assert_grad1(trainable, renamed(want, {"s": "0", "c": "1"}), f"step {step}")
            opt.step()


def test_temporal_ensembling_targets_kept_per_example_with_a_ramped_up_weight():
    """Temporal ensembling (Laine and Aila): each example's predictions averaged over epochs in
    a table indexed by the example (``Z[idx] = a Z[idx] + (1 - a) z``, bias-corrected), the
    consistency term an MSE to that target weighted by a Gaussian ramp-up, the cross-entropy
    on the labelled examples alone (a mask). Every term is an example's own: grad1 against
    the loop with the table's rows as targets."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data, labels = batch(0, n=10)
    labelled = torch.arange(10) % 3 == 0
    table = torch.zeros(10, 2, dtype=D)

    def loss_of(out, target, ramp):
        y, mask, goal = target[:, 0].long(), target[:, 1], target[:, 2:]
        ce = (mask * F.cross_entropy(out, y, reduction="none")).sum() / out.shape[0]
        return ce + ramp * (F.softmax(out, 1) - goal).pow(2).sum() / out.shape[0]

    with gradhooks.add_hooks(model):
        for epoch in range(STEPS):
            ramp = 30 * float(torch.exp(torch.tensor(-5 * (1 - epoch / STEPS) ** 2)))
            for idx in (torch.tensor([0, 3, 4, 7, 9]), torch.tensor([1, 2, 5, 6, 8])):
                x = data[idx] + 0.05 * torch.randn(5, 3, dtype=D)
                goal = (
                    table[idx] / (1 - 0.6 ** (epoch + 1)) if epoch else torch.zeros(5, 2, dtype=D)
                )
                target = torch.cat([labels[idx, None].to(D), labelled[idx, None].to(D), goal], 1)
                opt.zero_grad()
                out = model(x)
                loss_of(out, target, ramp).backward()
                want = loop_grad(model, lambda o, t, ramp=ramp: loss_of(o, t, ramp), x, target)
                assert_grad1(model, want, f"epoch {epoch}")
                opt.step()
                table[idx] = 0.6 * table[idx] + 0.4 * F.softmax(out.detach(), 1)


def test_fixmatch_labelled_and_unlabelled_batches_in_two_forwards_are_refused():
    """FixMatch written with two forwards, the labelled batch and the unlabelled batch's
    strong views (of another size), in one loss: no example has rows in both, so the sum has
    no per-example rows. Refused (``StateError`` naming the layer and both sizes, saying to
    concatenate), with no grad1 left; one forward of the concatenated batch, as the official
    code interleaves it, is right (``test_idioms_eighth``)."""
    model = mlp()
    xl, yl = batch(0, n=4)
    xu, _ = batch(1, n=8)
    with gradhooks.add_hooks(model):
        with torch.no_grad():
            conf, pseudo = F.softmax(model(xu), 1).max(1)
        mask = (conf > 0.5).to(D)
        strong = xu + 0.1 * torch.randn_like(xu)
        unlabelled = mask * F.cross_entropy(model(strong), pseudo, reduction="none")
        loss = F.cross_entropy(model(xl), yl) + unlabelled.mean()
        with pytest.raises(
            gradhooks.StateError, match=r"'\d\.weight'.*batch size changed.*concatenate"
        ):
            loss.backward()
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), n


# -- loss shaping --------------------------------------------------------------------------------


def test_co_teaching_each_network_trained_on_the_examples_its_peer_finds_easy():
    """Co-teaching (Han et al. 2018, bhanML/Co-teaching, ``loss.py``): two hooked networks
    rank the batch by their losses, and each is trained on the ``k`` examples its peer's
    ranking puts first (``loss_1[ind_2_update]`` averaged over ``k``), both backwards in one
    step. grad1 is ``1 / k`` times each chosen example's gradient, zero for the others."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)
    b = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    k = 4
    with gradhooks.add_hooks(a, loss_reduction="sum"), gradhooks.add_hooks(b, loss_reduction="sum"):
        for step in range(STEPS):
            x, y = batch(step, n=6)
            loss_a = F.cross_entropy(a(x), y, reduction="none")
            loss_b = F.cross_entropy(b(x), y, reduction="none")
            easy_a = torch.argsort(loss_a.detach())[:k]
            easy_b = torch.argsort(loss_b.detach())[:k]
            opt_a.zero_grad()
            opt_b.zero_grad()
            (loss_a[easy_b].sum() / k).backward()
            (loss_b[easy_a].sum() / k).backward()
            for net, chosen, name in ((a, easy_b, "a"), (b, easy_a, "b")):
                w = torch.zeros(6, dtype=D)
                w[chosen] = 1 / k
                want = weighted(loop_grad(net, F.cross_entropy, x, y), w)
                assert_grad1(net, want, f"step {step}: network {name}")
            opt_a.step()
            opt_b.step()


class TwoTasks(nn.Module):
    """A shared trunk with a classification head and a regression head, and the two tasks'
    log-variances (Kendall et al. 2018) as a parameter of the model that its forward does not
    use: the loop weights the task losses with them."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.cls = nn.Linear(6, 2)
        self.reg = nn.Linear(6, 1)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h).squeeze(1)


def uncertainty_rows(outs, y, t, log_vars):
    """``exp(-s_1) * CE + s_1 + exp(-s_2) * SE + s_2`` per example."""
    logits, value = outs
    ce, se = F.cross_entropy(logits, y, reduction="none"), (value - t) ** 2
    return torch.exp(-log_vars[0]) * ce + log_vars[0] + torch.exp(-log_vars[1]) * se + log_vars[1]


def test_learned_log_variances_used_in_the_loss_are_warned_and_refused_by_the_dp_step():
    """The log-variances used in the loss, after the forward: the hooks see no call that uses
    them, so they get ``.grad`` and no grad1, and the backward warns naming them (the
    network's own parameters get theirs); the DP step, which would give them no clipped
    share, refuses (``StateError`` naming them) before changing anything."""
    torch.manual_seed(0)
    model = TwoTasks().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model) as h:
        for step in range(STEPS):
            x, y = batch(step)
            t = x.sum(1)
            opt.zero_grad()
            with pytest.warns(gradhooks.GradhooksWarning, match="'log_vars'"):
                uncertainty_rows(model(x), y, t, model.log_vars).mean().backward()
            assert model.log_vars.grad is not None and not hasattr(model.log_vars, "grad1")
            for n, p in model.named_parameters():
                if n != "log_vars":
                    assert p.grad1.shape == (5, *p.shape), n
            opt.step()
        opt.zero_grad()
        x, y = batch(9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gradhooks.GradhooksWarning)
            with pytest.raises(gradhooks.StateError, match="'log_vars'"):
                gradhooks.dp_sgd_step(
                    h, uncertainty_rows(model(x), y, x.sum(1), model.log_vars), max_norm=1.0,
                    noise_multiplier=0.0,
                )  # fmt: skip
    for n, p in model.named_parameters():
        assert p.grad is None or not p.grad.any(), n


class AutomaticWeightedLoss(nn.Module):
    """Mikoto10032/AutomaticWeightedLoss (``AutomaticWeightedLoss.py``): the tasks' losses
    weighted by ``0.5 / c_i**2`` plus ``log(1 + c_i**2)``, ``c`` learned."""

    def __init__(self, tasks: int = 2) -> None:
        super().__init__()
        self.params = nn.Parameter(torch.ones(tasks))

    def forward(self, *losses):
        return sum(
            0.5 / self.params[i] ** 2 * loss + torch.log(1 + self.params[i] ** 2)
            for i, loss in enumerate(losses)
        )


class Weighted(nn.Module):
    def __init__(self, net: nn.Module, awl: nn.Module) -> None:
        super().__init__()
        self.net, self.awl = net, awl

    def forward(self, x, y, t):
        logits, value = self.net(x)
        return self.awl(F.cross_entropy(logits, y, reduction="none"), (value - t) ** 2)


def test_automatic_weighted_loss_given_each_examples_task_losses():
    """The weighting as a module trained beside the network (both in a hooked
    ``nn.ModuleList``), given each example's task losses (``reduction="none"``) and averaged
    after: its ``c`` gets each example's gradient (from the torch.func fallback, a module
    without a rule), and so does the network."""
    torch.manual_seed(0)
    net, awl = TwoTasks().to(D), AutomaticWeightedLoss().to(D)
    net.log_vars.requires_grad_(False)
    both = nn.ModuleList([net, awl])
    opt = torch.optim.Adam(both.parameters(), lr=0.05)
    with gradhooks.add_hooks(both):
        for step in range(STEPS):
            x, y = batch(step)
            t = x.sum(1)
            opt.zero_grad()
            logits, value = net(x)
            awl(F.cross_entropy(logits, y, reduction="none"), (value - t) ** 2).mean().backward()
            want = loop_grad(Weighted(net, awl), lambda out: out.sum(), (x, y, t))
            want = renamed(want, {"net": "0", "awl": "1"})
            assert_grad1(both, want, f"step {step}")
            opt.step()


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_automatic_weighted_loss_of_each_example_into_the_dp_step(method):
    """The weighted losses, one per example, into ``dp_sgd_step`` (noise 0): the weighting's
    ``c`` is clipped with the network, each example's gradient as a whole, by every method
    (the weighting's norms from the fallback's rows). ``.grad`` is the mean of the loop's
    rows, each clipped to ``C``."""
    torch.manual_seed(0)
    net, awl = TwoTasks().to(D), AutomaticWeightedLoss().to(D)
    net.log_vars.requires_grad_(False)
    both = nn.ModuleList([net, awl])
    x, y = batch(3)
    t = x.sum(1)
    want = loop_grad(Weighted(net, awl), lambda out: out.sum(), (x, y, t))
    want = renamed(want, {"net": "0", "awl": "1"})
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    factor = (0.5 / norms).clamp(max=1.0)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(both, quantities=quantities) as h:
        logits, value = net(x)
        rows = awl(F.cross_entropy(logits, y, reduction="none"), (value - t) ** 2)
        got = gradhooks.dp_sgd_step(h, rows, max_norm=0.5, noise_multiplier=0.0, method=method)
    assert_close(got, norms, f"{method}: norms")
    assert factor.min() < 1, "some example is clipped"
    for n, p in both.named_parameters():
        if p.requires_grad:
            clipped = (factor.view(-1, *[1] * (want[n].dim() - 1)) * want[n]).sum(0) / 5
            assert_close(p.grad, clipped, f"{method}: .grad of {n}")


def test_automatic_weighted_loss_given_the_batch_means_is_refused():
    """Given the batch means of the task losses, as its README shows, the weighting module's
    call has no batch: refused (``UnbatchedInputError`` naming the module) at its call."""
    torch.manual_seed(0)
    net, awl = TwoTasks().to(D), AutomaticWeightedLoss().to(D)
    net.log_vars.requires_grad_(False)
    x, y = batch(0)
    with gradhooks.add_hooks(nn.ModuleList([net, awl])):
        gc.collect()  # (the container, held by nothing: its modules stay hooked)
        logits, value = net(x)
        with pytest.raises(gradhooks.UnbatchedInputError, match="AutomaticWeightedLoss"):
            awl(F.cross_entropy(logits, y), F.mse_loss(value, x.sum(1)))

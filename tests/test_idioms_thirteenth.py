"""Training-loop idioms, a thirteenth set: recipes that change what happens between the forward,
the backward and the optimizer's step.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a recipe the earlier sets do not run: sharpness-aware minimisation with its first pass
under ``hooks.paused()`` and the weights moved by ``torch._foreach_add_``, in its closure form
(the second pass inside the optimizer's ``step``), and differentially private (two DP steps per
step, the second at the weights the first one's noisy gradient moved); the hooked model as its
own teacher under ``no_grad`` or ``inference_mode`` between the student's forward and its
backward, or through ``torch.func.functional_call`` with an exponential moving average of its
weights; an ``AveragedModel`` teacher evaluated in that same place; a teacher head that shares
the student's trunk; two augmented views of each example in one forward with a consistency
loss per pair, in the DP step; virtual adversarial training, its power iteration taken by
``torch.autograd.grad``; peft's ``merge_adapter`` / ``unmerge_adapter`` for an evaluation
between steps and two adapters trained in turn by ``set_adapter``; chain-thaw (layers unfrozen
and frozen again, each with its own learning rate); a sequence length, and an image size, that
grow from step to step; a batch size that grows from epoch to epoch through the DP step, each
epoch's last batch smaller; DP fine-tuning whose trainable layers change between steps; a
peer's weights run through the hooked model by ``functional_call`` and trained on one loss
with it; StyleGAN2's path length penalty (a gradient penalty through ``w``), refused, then run
paused. And misuse: a model converted to another dtype mid-training with its optimizer built
before, and ``grad1`` of another parameter read from a ``register_post_accumulate_grad_hook``.
Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), or with the DP step's clipped sum of those, or checked to
stop with an error that says what went wrong."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1
from harness import labelled_batch as batch
from harness import wide_mlp as mlp

D = torch.float64
STEPS = 3


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def clipped_sum(want: dict, name: str, max_norm: float) -> torch.Tensor:
    """The sum over the examples of parameter ``name``'s rows of ``want``, each example's
    gradient clipped to ``max_norm`` over all parameters (the DP step's sum before the noise)."""
    factors = (max_norm / norms_of(want)).clamp(max=1.0)
    return torch.einsum("b,b...->...", factors, want[name])


# -- sharpness-aware minimisation --------------------------------------------------------------


def _sam_steps(model: nn.Module, hooks: gradhooks.Hooks | None) -> None:
    """``STEPS`` SAM steps; with ``hooks``, the first pass paused and the second checked."""
    params = list(model.parameters())
    base = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        base.zero_grad()
        with hooks.paused() if hooks is not None else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        if hooks is not None and step == 0:
            assert not any(hasattr(p, "grad1") for p in params), "the paused pass wrote grad1"
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        with torch.no_grad():  # first_step
            e_w = torch._foreach_mul([p.grad for p in params], 0.05 / float(norm))
            torch._foreach_add_(params, e_w)
        base.zero_grad()
        if hooks is not None:
            want = loop_grad(model, F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        if hooks is not None:
            assert_grad1(model, want, f"step {step}, second pass")
            assert_close(hooks.norms(), norms_of(want), f"step {step}: norms")
        with torch.no_grad():  # second_step
            torch._foreach_sub_(params, e_w)
        base.step()


def test_sam_with_its_first_pass_paused_and_the_weights_moved_by_foreach():
    """SAM as the SAM repository's optimizer runs it (davda54/sam, ``sam.py``: ``first_step``
    moves every weight by ``e(w) = ρ·g/‖g‖`` in place, ``second_step`` moves it back and steps
    the base optimizer), with the first pass under ``hooks.paused()``, since only the second
    pass's per-example gradients are wanted (the norms logged), and the moves made by
    ``torch._foreach_add_`` / ``_foreach_sub_``. The paused pass writes no grad1 (its ``.grad``
    is autograd's); the second pass's grad1 and norms are the loop's at ``w + e(w)``, and the
    weights after the steps are those of the same loop run without gradhooks."""
    model, twin = mlp(), mlp()
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        _sam_steps(model, hooks)
    _sam_steps(twin, None)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_sam_two_dp_steps_per_step_the_second_at_the_weights_the_first_moved(method):
    """Differentially private SAM (Park et al., 2023, "Differentially Private
    Sharpness-Aware Training"): the ascent direction is the first DP step's noisy clipped
    gradient (noise from a seeded generator), the weights move by ``ρ·g/‖g‖`` in place, and
    the descent gradient is a second DP step, taken at the moved weights, after which the move
    is undone and SGD steps. The second step's norms and ``.grad`` (no noise: the clipped sum
    over the batch size) are the float64 loop's at the moved weights, at every step."""
    model = mlp()
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            gradhooks.dp_sgd_step(
                hooks, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.5,
                noise_multiplier=1.0, generator=torch.Generator().manual_seed(step), method=method,
            )  # fmt: skip
            params = list(model.parameters())
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            moves = [p.grad * 0.05 / norm for p in params]
            with torch.no_grad():
                for p, e in zip(params, moves, strict=True):
                    p.add_(e)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            norms = gradhooks.dp_sgd_step(
                hooks, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.5,
                noise_multiplier=0.0, method=method,
            )  # fmt: skip
            assert_close(norms, norms_of(want), f"step {step}: norms at the moved weights")
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped_sum(want, n, 0.5) / len(x), f"step {step}: {n}")
            with torch.no_grad():
                for p, e in zip(params, moves, strict=True):
                    p.sub_(e)
            opt.step()


class _ClosureSAM(torch.optim.Optimizer):
    """SAM in the SAM repository's closure form (davda54/sam, ``sam.py``: ``step`` runs under
    ``torch.no_grad()``, wraps the closure in ``torch.enable_grad()``, moves the weights by
    ``e(w)`` and zeroes the gradients, calls the closure for the second pass, moves the
    weights back and steps the base optimizer, which shares its parameter groups)."""

    def __init__(self, params, base: type, rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure):
        closure = torch.enable_grad()(closure)
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.norm() for g in grads]).norm()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["e_w"] = p.grad * (group["rho"] / (norm + 1e-12))
                    p.add_(self.state[p]["e_w"])
        self.zero_grad()
        closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p].pop("e_w"))
        self.base.step()


def test_sam_in_its_closure_form_the_second_pass_inside_the_optimizers_step():
    """SAM driven as ``optimizer.step(closure)``: the first pass in the loop, the second
    forward and backward inside the optimizer's ``step``, under its ``no_grad`` with the
    closure's ``enable_grad``. Each pass's grad1 is the loop's at the weights it ran at (the
    second read inside the closure, after its backward)."""
    model = mlp()
    opt = _ClosureSAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    second = []
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)

            def closure(x=x, y=y, step=step):
                want = loop_grad(model, F.cross_entropy, x, y)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                assert_grad1(model, want, f"step {step}, second pass")
                second.append(step)
                return loss

            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, first pass")
            opt.step(closure)
            opt.zero_grad()
    assert second == list(range(STEPS))


# -- teachers: the hooked model itself, its average, a head on the student's trunk -------------


def _distill(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the labels plus the KL divergence to the teacher's logits, averaged
    over the batch; ``target`` holds the label in column 0 and the teacher's logits after it
    (so that the loop hands each example its own)."""
    y, teacher = target[:, 0].long(), target[:, 1:]
    kl = F.kl_div(
        out.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    return F.cross_entropy(out, y) + kl


def _with_labels(y: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return torch.cat([y[:, None].to(teacher.dtype), teacher], 1)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_hooked_model_as_its_own_teacher_between_the_students_forward_and_backward(mode):
    """Self-distillation in one step: the student's forward, then the same hooked model, under
    ``torch.no_grad()`` or ``torch.inference_mode()``, on two perturbed copies of the batch at
    once (another batch size, its logits averaged per example), then the backward of the
    distillation loss. The teacher's forward captures nothing and leaves the student's calls
    as they were: grad1 is the loop's, the teacher's logits a fixed target, over AdamW steps."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grad_off = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            views = torch.cat([x + 0.1, x - 0.1])
            opt.zero_grad()
            out = model(x)
            with grad_off():
                teacher = model(views).view(2, len(x), -1).mean(0)
            target = _with_labels(y, teacher.clone())
            want = loop_grad(model, _distill, x, target)
            _distill(out, target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def _lerp_into(average: dict, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            average[n].lerp_(p, 1 - decay)


@pytest.mark.parametrize("how", ["no_grad", "grad enabled", "grad enabled, dp step"])
def test_mean_teacher_by_functional_call_of_the_hooked_model_between_forward_and_backward(how):
    """A mean teacher kept as a dict of tensors (an exponential moving average of the weights,
    updated by ``lerp_`` after each step) and run through the hooked model itself by
    ``torch.func.functional_call(model, average, x)``, between the student's forward and its
    backward, its logits detached (under ``no_grad``, or with grad enabled and ``.detach()``,
    as mean-teacher code often writes it). The student's grad1 is the loop's, with the
    teacher's logits a fixed target; so are the DP step's norms and clipped sum.

    With grad enabled, the teacher's forward planned the hooks for the average's tensors in
    the parameters' slots, and dropped the parameters' own: the student's backward wrote no
    grad1, silently, and the DP step refused the parameters as having no rule. The backward
    (and the step) now plan them again first."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    average = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = how.endswith("dp step")
    with gradhooks.add_hooks(model, quantities=("norms",) if dp else ("grad1",)) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            out = model(x)
            if how == "no_grad":
                with torch.no_grad():
                    teacher = functional_call(model, average, (x + 0.1,))
            else:
                teacher = functional_call(model, average, (x + 0.1,)).detach()
            target = _with_labels(y, teacher)
            want = loop_grad(model, _distill, x, target)
            if dp:
                losses = torch.stack(
                    [_distill(out[i : i + 1], target[i : i + 1]) for i in range(len(x))]
                )
                norms = gradhooks.dp_sgd_step(hooks, losses, max_norm=0.5, noise_multiplier=0.0)
                assert_close(norms, norms_of(want), f"step {step}: norms")
                for n, p in model.named_parameters():
                    assert_close(p.grad, clipped_sum(want, n, 0.5) / len(x), f"step {step}: {n}")
            else:
                _distill(out, target).backward()
                assert_grad1(model, want, f"step {step}")
            opt.step()
            _lerp_into(average, model, 0.9)


def _mutual(out: torch.Tensor, peer: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Deep mutual learning's loss for two networks: each one's cross-entropy and its KL
    divergence to the other's detached prediction, averaged over the batch."""
    ce = F.cross_entropy(out, y) + F.cross_entropy(peer, y)
    return ce + (_kl(peer.detach(), out) + _kl(out.detach(), peer)).mean()


def test_a_peers_weights_run_through_the_hooked_model_by_functional_call_in_the_same_loss():
    """Two networks of one architecture trained together on one loss (deep mutual learning),
    the peer's weights kept as leaf tensors of their own and run through the hooked model by
    ``functional_call`` after the model's own forward: one backward reaches the calls of both
    plans, the model's parameters' (dropped by the peer's forward) and the peer's tensors'.
    Each gets its own grad1, each example's gradient by a per-example loop in float64, over
    SGD steps of both."""
    model = mlp()
    peer = {n: (p.detach() + 0.05).requires_grad_() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([*model.parameters(), *peer.values()], lr=0.1)

    def loss_fn(net_out_and_peer, y):
        return _mutual(net_out_and_peer[:, 0], net_out_and_peer[:, 1], y)

    def both(x):
        return torch.stack([model(x), functional_call(model, peer, (x,))], 1)

    tensors = {**dict(model.named_parameters()), **{f"peer {n}": t for n, t in peer.items()}}
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            rows = {n: [] for n in tensors}
            with gradhooks.paused():  # the loop: each example's own loss
                for i in range(len(x)):
                    loss = loss_fn(both(x[i : i + 1]), y[i : i + 1])
                    for n, g in zip(tensors, torch.autograd.grad(loss, list(tensors.values()))):
                        rows[n].append(g)
            opt.zero_grad()
            loss_fn(both(x), y).backward()
            for n, t in tensors.items():
                assert_close(t.grad1, torch.stack(rows[n]), f"step {step}: {n}")
            opt.step()


def test_an_averaged_model_teacher_evaluated_between_forward_and_backward():
    """``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` (pytorch/pytorch,
    ``torch/optim/swa_utils.py``: a deep copy of the hooked model, which is not hooked) as a
    mean teacher, called with grad enabled between the student's forward and its backward
    and its logits detached, then updated after the step: the student's grad1 is the loop's,
    the average never gets one, and its weights are the EMA of the student's."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        want_ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            out = model(x)
            target = _with_labels(y, ema(x + 0.1).detach())
            want = loop_grad(model, _distill, x, target)
            _distill(out, target).backward()
            assert_grad1(model, want, f"step {step}")
            assert not any(hasattr(p, "grad1") for p in ema.parameters())
            opt.step()
            ema.update_parameters(model)
            if step:  # (the first update copies the weights)
                _lerp_into(want_ema, model, 0.9)
            else:
                want_ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in ema.module.named_parameters():
        torch.testing.assert_close(p.detach(), want_ema[n], msg=n)


class _SharedTrunk(nn.Module):
    """A student head and a frozen teacher head on one trunk; the teacher's call of the trunk
    (on a perturbed input) runs with grad enabled and its logits are detached, as a
    ``forward`` that returns both often does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.student, self.teacher = nn.Linear(3, 6), nn.Linear(6, 2), nn.Linear(6, 2)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        teacher = self.teacher(torch.tanh(self.trunk(x + 0.3))).detach()
        return torch.stack([self.student(torch.tanh(self.trunk(x))), teacher], 1)


def _shared_distill(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _distill(out[:, 0], _with_labels(y, out[:, 1]))


def test_a_layer_frozen_and_a_forward_with_grad_between_the_students_forward_and_backward():
    """Between the student's forward and its backward, the first layer frozen
    (``requires_grad_(False)``, a teacher's or an evaluation's setting) and another forward
    with grad on a few of the examples, never backpropagated: that forward plans the hooks
    without the frozen layer. The backward runs, the trainable layer's grad1 is the loop's, and
    the frozen one gets none, as autograd leaves its ``.grad`` (``None``), at every step, as
    where the layer is frozen without the forward between (the fifth set). The re-hooking
    of the dropped parameters raised torch's "cannot register a hook on a tensor that doesn't
    require gradient" from inside the backward; before it, the frozen layer got a grad1."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            model.requires_grad_(True)
            opt.zero_grad()
            out = model(x)
            model[0].requires_grad_(False)
            model(x[:2])
            F.cross_entropy(out, y).backward()
            assert model[0].weight.grad is None
            want = loop_grad(model, F.cross_entropy, x, y)
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()


def test_a_teacher_head_that_shares_the_students_trunk():
    """Distillation from a frozen teacher head on the student's own trunk: the trunk runs twice
    per forward, once for each head, and the backward reaches only the student's call. The
    trunk's and the student head's grad1 are the loop's (the teacher's logits computed per
    example there too), the frozen head gets none, over SGD steps."""
    model = _SharedTrunk().to(D)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, _shared_distill, x, y)
            opt.zero_grad()
            _shared_distill(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()


# -- two augmented views of each example in one forward ----------------------------------------


class _TwoViews(nn.Module):
    """Both views of each example (``[batch, 2, features]``) through the network in one
    forward, concatenated along the batch (``torch.cat([x[:, 0], x[:, 1]])``, as UDA and
    SimCLR-style code runs its views), the logits paired again per example."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, views):
        out = self.net(torch.cat([views[:, 0], views[:, 1]]))
        return torch.stack(out.chunk(2), 1)


def _consistency(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The first view's cross-entropy plus the squared distance between the two views'
    probabilities (no stop-gradient: both views are trained), per example."""
    first, second = out[:, 0], out[:, 1]
    losses = F.cross_entropy(first, y, reduction="none")
    losses = losses + (first.softmax(-1) - second.softmax(-1)).square().sum(-1)
    return losses.mean() if reduction == "mean" else losses


def test_two_views_in_one_forward_with_a_consistency_loss_per_pair_in_the_dp_step():
    """Consistency training under DP: each example's two augmented views go through the network
    in one forward of twice the batch, and one loss per example couples them. Hooked on the
    module that pairs the views (its input's dimension 0 holds the examples), each example's
    norm is that of its gradient through both views, and the DP step's ``.grad`` is the clipped
    sum of the loop's, at every step. Hooked on the inner network, whose input has twice as many
    rows as there are losses, the step is refused, naming both sizes, with nothing written."""
    model = _TwoViews(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            g = torch.Generator().manual_seed(50 + step)
            views = torch.stack([x, x + 0.3 * torch.randn(x.shape, generator=g, dtype=D)], 1)
            want = loop_grad(model, _consistency, views, y)
            opt.zero_grad()
            norms = gradhooks.dp_sgd_step(
                hooks, _consistency(model(views), y, "none"), max_norm=0.5, noise_multiplier=0.0
            )
            assert_close(norms, norms_of(want), f"step {step}: norms")
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped_sum(want, n, 0.5) / len(x), f"step {step}: {n}")
            opt.step()
    with gradhooks.add_hooks(model.net, quantities=("norms",)) as hooks:
        opt.zero_grad()
        with pytest.raises(gradhooks.ConfigurationError, match=r"5 entries.*batch of 10"):
            gradhooks.dp_sgd_step(
                hooks, _consistency(model(views), y, "none"), max_norm=0.5, noise_multiplier=0.0
            )
        assert all(p.grad is None for p in model.parameters())


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per example, from logits."""
    return (p_logits.softmax(-1) * (p_logits.log_softmax(-1) - q_logits.log_softmax(-1))).sum(-1)


class _CleanAndPerturbed(nn.Module):
    """The network on each example's clean input and on its perturbed one (``[batch, 2,
    features]``), in two calls: what the VAT loss below runs, for the per-example loop."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pair):
        return torch.stack([self.net(pair[:, 0]), self.net(pair[:, 1])], 1)


def _vat_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the clean input plus the KL divergence from the clean prediction (a
    fixed target: column 1 on of ``target``) to the perturbed one's."""
    y, clean = target[:, 0].long(), target[:, 1:]
    return F.cross_entropy(out[:, 0], y) + _kl(clean, out[:, 1]).mean()


def test_virtual_adversarial_training_with_its_power_iteration_taken_by_autograd_grad():
    """Virtual adversarial training (Miyato et al.): the clean prediction under ``no_grad``,
    one power iteration (a random direction ``d`` that requires grad, the hooked model on
    ``x + ξd``, ``torch.autograd.grad`` of the KL divergence with respect to ``d`` alone,
    hooks not paused), the adversarial perturbation ``ε·g/‖g‖`` per example, then the loss:
    cross-entropy on ``x`` and the KL divergence at ``x + r_adv``. The iteration writes no
    grad1 and no ``.grad``; each example's grad1 is its gradient through both calls of the
    loss, the loop's, over SGD steps."""
    model = mlp()
    pair = _CleanAndPerturbed(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            with torch.no_grad():
                clean = model(x)
            d = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + step), dtype=D)
            d = (0.1 * d / d.norm(dim=1, keepdim=True)).requires_grad_()
            (g,) = torch.autograd.grad(_kl(clean, model(x + d)).sum(), [d])
            assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())
            r_adv = 0.5 * g / g.norm(dim=1, keepdim=True)
            target = _with_labels(y, clean)
            want = loop_grad(pair, _vat_loss, torch.stack([x, x + r_adv], 1), target)
            loss = F.cross_entropy(model(x), y) + _kl(clean, model(x + r_adv)).mean()
            loss.backward()
            assert_grad1(model, {n[len("net.") :]: w for n, w in want.items()}, f"step {step}")
            opt.step()


# -- peft: adapters merged for an evaluation, two adapters in turn ------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _lora(**kwargs):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, target_modules=["a", "b"], lora_dropout=0.0, init_lora_weights=False
    )
    return peft, peft.get_peft_model(_Net().to(D), config, **kwargs).to(D), config


def test_peft_lora_merged_for_an_evaluation_and_unmerged_between_steps():
    """An evaluation with the LoRA update merged into the frozen base weights
    (``merge_adapter()``: peft's ``src/peft/tuners/lora/layer.py`` adds ``B A`` to the base
    layer's weight in place, and its forward then skips the adapter), then
    ``unmerge_adapter()`` and the next training step. The merged model gives the unmerged
    one's logits; each step's grad1, on the adapter's parameters only, is the loop's."""
    _, model, _ = _lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()
            with torch.no_grad():
                unmerged = model(x)
                model.merge_adapter()
                merged = model(x)
                model.unmerge_adapter()
            torch.testing.assert_close(merged, unmerged)


def test_peft_two_lora_adapters_trained_in_turn_by_set_adapter():
    """Two LoRA adapters on one base model trained in turn (``set_adapter`` makes one active
    and trainable, the other frozen and unused), one optimizer over both, ``zero_grad`` each
    step: the active adapter's grad1 is the loop's; the other's, reset by ``zero_grad`` and
    not reached, is gone, as its ``.grad`` is."""
    _, model, config = _lora(adapter_name="one")
    model.add_adapter("two", config)
    model.to(D)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.SGD(adapters, lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            active = ("one", "two")[step % 2]
            model.set_adapter(active)
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step} ({active})")
            for n, p in model.named_parameters():
                assert hasattr(p, "grad1") == (f".{active}." in n), n
                assert (p.grad is not None) == (f".{active}." in n), n
            opt.step()


# -- what trains changes between steps ---------------------------------------------------------


def test_chain_thaw_layers_unfrozen_and_frozen_again_with_layer_wise_learning_rates():
    """Chain-thaw (DeepMoji's fine-tuning): one layer trained at a time, then all together,
    each layer with its own learning rate (a parameter group per layer, decayed from the top
    as layer-wise learning-rate decay does), ``requires_grad_`` toggled between steps and
    ``zero_grad`` over all groups. Each step's grad1 is on the trainable layers alone and is
    the loop's; a layer frozen again loses its grad1 with its ``.grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))
    model = model.to(D)
    layers = [model[0], model[2], model[4]]
    groups = [
        {"params": list(m.parameters()), "lr": 0.1 * 0.5 ** (2 - i)} for i, m in enumerate(layers)
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    schedule = [[2], [0], [1], [0, 1, 2]]  # the head, then one layer at a time, then all
    with gradhooks.add_hooks(model):
        for step, thawed in enumerate(schedule):
            for i, m in enumerate(layers):
                m.requires_grad_(i in thawed)
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_fine_tuning_whose_trainable_layers_change_between_steps(method):
    """DP fine-tuning with gradual unfreezing, then the lower layers frozen again: the head,
    then the head and the middle layer, then all three, then the head alone. Each DP step
    clips over the parameters trainable at that step (the norms are the loop's over those)
    and draws its noise for those alone, in order (``torch.randn`` of each one's shape from
    the seeded generator, times σ·C, over the batch size); a frozen layer's ``.grad`` stays
    ``None``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))
    model = model.to(D)
    layers = [model[0], model[2], model[4]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        for step, thawed in enumerate([[2], [1, 2], [0, 1, 2], [2]]):
            for i, m in enumerate(layers):
                m.requires_grad_(i in thawed)
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            norms = gradhooks.dp_sgd_step(
                hooks, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.5,
                noise_multiplier=1.0, generator=torch.Generator().manual_seed(step),
                method=method,
            )  # fmt: skip
            assert_close(norms, norms_of(want), f"step {step}: norms")
            g = torch.Generator().manual_seed(step)
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    assert p.grad is None, f"step {step}: frozen {n} got a .grad"
                    continue
                noise = 0.5 * torch.randn(p.shape, generator=g, dtype=D)
                want_grad = (clipped_sum(want, n, 0.5) + noise) / len(x)
                assert_close(p.grad, want_grad, f"step {step}: {n}")
            opt.step()


class _Decoder(nn.Module):
    """A causal decoder: token and learned position embeddings (the table sliced to the
    sequence's length), a Transformer layer with a causal mask made for that length, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(7, 8)
        self.positions = nn.Parameter(0.1 * torch.randn(12, 8))
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 7)

    def forward(self, ids):
        length = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=self.head.weight.dtype)
        h = self.tokens(ids) + self.positions[:length]
        return self.head(self.layer(h, src_mask=mask, is_causal=True))


def _next_token(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def test_sequence_length_warm_up_on_a_causal_decoder():
    """Sequence-length warm-up (curriculum learning for language models: the sequences grow
    from step to step, 3, 5, 8 then 12 tokens, the whole position table): at each length every
    parameter's grad1 (the position table's, sliced, and the Transformer layer's, recomputed
    per call) is the loop's, each example's loss summed over its tokens, over AdamW steps."""
    model = _Decoder().to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step, length in enumerate([3, 5, 8, 12]):
            ids = torch.randint(7, (4, length), generator=torch.Generator().manual_seed(step))
            want = loop_grad(model, _next_token, ids, ids)
            opt.zero_grad()
            _next_token(model(ids), ids).backward()
            assert_grad1(model, want, f"length {length}")
            opt.step()


class _ConvNet(nn.Module):
    """A convolution, an adaptive average pool (any image size), a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, images):
        return self.head(F.adaptive_avg_pool2d(torch.tanh(self.conv(images)), 1).flatten(1))


def test_progressive_resizing_of_the_images_from_epoch_to_epoch():
    """Progressive resizing (fastai's and the fast ImageNet schedules: small images first,
    larger later), here 4, 6 then 9 pixels a side through a convolution and an adaptive pool:
    at each size the convolution's grad1, summed over more positions, and the head's are the
    loop's, over momentum SGD steps."""
    model = _ConvNet().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step, size in enumerate([4, 6, 9]):
            g = torch.Generator().manual_seed(step)
            images = torch.randn(4, 3, size, size, generator=g, dtype=D)
            y = torch.randint(2, (4,), generator=g)
            want = loop_grad(model, F.cross_entropy, images, y)
            opt.zero_grad()
            F.cross_entropy(model(images), y).backward()
            assert_grad1(model, want, f"{size} pixels")
            opt.step()


def test_a_batch_size_schedule_through_the_dp_step_with_each_epochs_last_batch_smaller():
    """A batch size that doubles every epoch (2, 4, 8, as batch-size warm-up schedules do) over
    11 examples, ``DataLoader(drop_last=False)``: each epoch ends on a smaller batch (1, 3, 3),
    and the DP step divides by the epoch's batch size (``expected_batch_size``), not the last
    batch's own. Each step's norms and ``.grad`` are the loop's clipped sum over it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(*batch(0, n=11))
    sizes = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        for size in (2, 4, 8):
            for x, y in DataLoader(data, batch_size=size):
                want = loop_grad(model, F.cross_entropy, x, y)
                opt.zero_grad()
                norms = gradhooks.dp_sgd_step(
                    hooks, F.cross_entropy(model(x), y, reduction="none"), max_norm=1.0,
                    noise_multiplier=0.0, expected_batch_size=float(size),
                )  # fmt: skip
                assert_close(norms, norms_of(want), f"batch of {len(x)}: norms")
                for n, p in model.named_parameters():
                    assert_close(
                        p.grad, clipped_sum(want, n, 1.0) / size, f"batch of {len(x)}: {n}"
                    )
                opt.step()
                sizes.append(len(x))
    assert sizes == [2] * 5 + [1] + [4, 4, 3] + [8, 3]


# -- gradient penalties ------------------------------------------------------------------------


class _Generator(nn.Module):
    """A mapping network (``z`` to ``w``) and a synthesis network (``w`` to an image), as a
    StyleGAN generator is split; returns both the image and ``w``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mapping = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.synthesis = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5))

    def forward(self, z):
        w = self.mapping(z)
        return self.synthesis(w), w


def _path_length_penalty(outputs, noise: torch.Tensor) -> torch.Tensor:
    """StyleGAN2's path length regularisation (NVlabs/stylegan2-ada-pytorch,
    ``training/loss.py``): the gradient of ``(image · noise).sum()`` with respect to ``w``, by
    ``torch.autograd.grad(create_graph=True)``, its norm per example pulled towards 1."""
    image, w = outputs
    (g,) = torch.autograd.grad((image * noise).sum(), w, create_graph=True)
    return (g.square().sum(-1).sqrt() - 1.0).square().mean()


def test_stylegan2_path_length_penalty_refused_then_run_paused():
    """The generator's path length penalty differentiates the synthesis network's
    input-gradient with respect to its weights (a double backward the hooks do not see), so
    its per-example gradients would be wrong: its backward is refused, naming a synthesis
    layer and ``create_graph=True``, with no ``.grad`` and no grad1 written. Run under
    ``hooks.paused()`` (a regulariser step, as the lazy R1 of the ninth set), it gives
    autograd's ``.grad`` and still no grad1; the next plain step's grad1 is the loop's."""
    model = _Generator().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    noise = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=D)

    def image_loss(outputs, y):
        return F.cross_entropy(outputs[0], y)

    twin = copy.deepcopy(model)
    with gradhooks.add_hooks(model) as hooks:
        z = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=D)
        with pytest.raises(gradhooks.UnsupportedError, match=r"'synthesis\.\d'.*create_graph=True"):
            _path_length_penalty(model(z), noise).backward()
        assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())
        with hooks.paused():
            _path_length_penalty(model(z), noise).backward()
        _path_length_penalty(twin(z), noise).backward()
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert not hasattr(p, "grad1"), n
            torch.testing.assert_close(p.grad, q.grad, msg=n)
        opt.step()
        y = torch.randint(5, (4,), generator=torch.Generator().manual_seed(2))
        want = loop_grad(model, image_loss, z, y)
        opt.zero_grad()
        image_loss(model(z), y).backward()
        assert_grad1(model, want, "the next step")


# -- misuse -------------------------------------------------------------------------------------


def test_a_model_converted_to_float32_mid_training_with_its_optimizer_built_before():
    """The optimizer built on the float64 model, two steps (its momentum buffers float64),
    then ``model.float()`` (as a precision switch mid-run does; the parameters stay the
    optimizer's, their data converted) and two more steps on float32 batches: grad1 follows
    the parameters' dtype and is within float32's rounding of the float64 loop at the same
    weights; before the switch it is the loop's to float64's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                model.float()
            dtype = model[0].weight.dtype
            x, y = batch(step)
            want = loop_grad(copy.deepcopy(model).to(D), F.cross_entropy, x.to(dtype).to(D), y)
            opt.zero_grad()
            F.cross_entropy(model(x.to(dtype)), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == dtype, n
            if dtype == D:
                assert_grad1(model, want, f"step {step}")
            else:  # float32: entries below 1, each a few roundings of 2^-24 (6e-8) off
                assert_grad1(model, want, f"step {step}", rtol=0, atol=1e-6)
            opt.step()
        assert opt.state[model[0].weight]["momentum_buffer"].dtype == D


def test_grad1_of_another_parameter_read_in_a_post_accumulate_grad_hook():
    """A hook fused into the backward (``register_post_accumulate_grad_hook`` on the output
    layer's weight, which autograd accumulates first) that reads the *first* layer's
    ``grad1`` (a per-layer statistic computed as soon as one gradient is ready), after
    ``zero_grad()``: the first layer's gradient of this step is not there yet, so its grad1
    must not be read as this step's. Its hook finds none (``hasattr`` is false), at every
    step, rather than the last step's; after the backward it is this step's, the loop's. In an
    accumulation (a second micro-batch, no ``zero_grad``) the hook finds the sum so far, the
    first micro-batch's, as ``.grad`` holds it then (docs/training.md)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def read(_):
        first = model[0].weight
        seen.append(first.grad1.clone() if hasattr(first, "grad1") else None)

    handle = model[2].weight.register_post_accumulate_grad_hook(read)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert seen[-1] is None, f"step {step}: the hook read a grad1 of another step"
            assert_grad1(model, want, f"step {step}")
            opt.step()
        x, y = batch(STEPS)
        F.cross_entropy(model(x), y).backward()  # a second micro-batch of the last step
        assert_close(seen[-1], want["0.weight"], "the sum so far, in the second micro-batch")
    handle.remove()

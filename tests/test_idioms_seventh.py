"""Published training loops, a seventh set, each step checked against the float64 oracle.

Each test writes again, on a small model, the idioms of one published loop that the earlier
sets do not run: fairseq's summed loss with ``optimizer.multiply_grads(1 / ntokens)``,
``--update-freq`` accumulation, its zeroed dummy batch and clipping over part of the model;
torchtune's output projection tied to the embedding through ``F.linear`` (``TiedLinear``),
applied to chunks of the sequence, with the gradients scaled by the token count; the SAM
repository's ``first_step`` / ``second_step`` (and ASAM) restoring the weights through
``p.data``; AdaHessian's ``backward(create_graph=True)`` and Hutchinson's Hessian-vector
products; GradNorm's task weights learned from the norms of the tasks' gradients; a penalty on
the gradient's norm; timm's ``train_one_epoch`` with its ``NativeScaler``, adaptive gradient
clipping, mixup's soft targets with ``SoftTargetCrossEntropy``, ``accum_steps`` and
``ModelEmaV3``; timm's ``Lookahead`` around a LAMB with gradient centralization and
``ReduceLROnPlateau``; Sophia's Gauss-Newton-Bartlett estimate from sampled labels; PEFT's
LoRA recipe with ``enable_input_require_grads`` and reentrant gradient checkpointing; a model
used through a method (CLIP's ``encode_text``) that reshapes the batch between its
submodules' calls; DINO's multi-crop student, MAE's masking and Stable-Baselines3's PPO
minibatches. Each is compared with each example's own gradient by a per-example loop in
float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out), or checked to stop with
an error that says what went wrong and leaves the model as it was.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, mlp

D = torch.float64


def batch(seed: int, n: int = 4):
    """``n`` examples of 3 features and their labels (2 classes), float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def added(a: dict, b: dict) -> dict:
    return {n: a[n] + b[n] for n in b}


def summed_ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_unchanged(model: nn.Module, before: list[torch.Tensor], what: str) -> None:
    for p, q in zip(model.parameters(), before, strict=True):
        assert_close(p.detach(), q, f"{what}: a parameter changed")


# -- fairseq: summed loss, multiply_grads(1 / ntokens), update_freq, the dummy batch ------------


def test_fairseq_summed_loss_grads_multiplied_by_one_over_the_sample_size():
    """fairseq's ``Trainer.train_step``: the criterion returns the loss *summed* over the batch
    and its sample size; ``--update-freq 2`` backwards two samples (the first under
    ``model.no_sync()``), then a zeroed dummy batch (``ignore_grad``: ``loss *= 0``, fairseq's
    stand-in for an empty shard), then ``optimizer.multiply_grads(1 / sample_size)`` (in place
    on ``.grad``), ``clip_grad_norm_`` over the encoder's parameters only, Adam's step, and
    ``zero_grad`` (``p.grad = None``). With ``loss_reduction="sum"``, grad1 is, row by row, the
    sum of each sample's examples' own summed-loss gradients, neither divided nor clipped."""
    model = mlp()
    encoder = list(model[0].parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        for step in range(3):
            want, sample_size = None, 0
            for micro in range(2):
                x, y = batch(10 * step + micro)
                got = loop_grad(model, summed_ce, x, y)
                want = got if want is None else added(want, got)
                summed_ce(model(x), y).backward()
                sample_size += len(y)
            x, y = batch(99)
            (summed_ce(model(x), y) * 0.0).backward()  # the dummy batch
            assert hooks.accumulated == 3
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():  # optimizer.multiply_grads
                p.grad.mul_(1 / sample_size)
            torch.nn.utils.clip_grad_norm_(encoder, 0.05)
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {step}: {n} after the clipping")
            optimizer.step()
            for p in model.parameters():  # fairseq's zero_grad
                p.grad = None


def test_fairseq_dummy_batch_of_another_size_is_refused_leaving_grad1():
    """fairseq's dummy batch is the first batch it saw, whatever the size of the samples it
    stands in for: in an accumulation, a zeroed backward of a batch of 3 after one of 4 has no
    rows to add to. Refused (naming the parameter and both shapes, saying what to do), with grad1
    left as the first backward wrote it and the parameters unchanged."""
    model = mlp()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        x, y = batch(0)
        want = loop_grad(model, summed_ce, x, y)
        summed_ce(model(x), y).backward()
        before = snapshot(model)
        with pytest.raises(
            gradhooks.StateError, match=r"'2\.weight'.*\(4, 2, 5\).*\(3, 2, 5\).*clear\(\)"
        ):
            (summed_ce(model(x[:3]), y[:3]) * 0.0).backward()
        assert_grad1(model, want, "after the refused dummy batch")
        assert_unchanged(model, before, "the refused dummy batch")


# -- torchtune: a tied output projection by F.linear, chunked, scaled by the token count -------


class TiedLinear:
    """torchtune's ``TiedLinear``: not a module; ``F.linear`` with the embedding's weight."""

    def __init__(self, tied: nn.Module):
        self.tied = tied

    def __call__(self, x):
        return F.linear(x, self.tied.weight)


class TunedDecoder(nn.Module):
    """torchtune's ``TransformerDecoder`` shrunk: token embedding, a layer, RMSNorm, and the
    output projection tied to the embedding, applied to ``chunks`` pieces of the sequence
    (``num_output_chunks``, for ``CEWithChunkedOutputLoss``)."""

    def __init__(self, chunks: int, vocab: int = 11, dim: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layer = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)
        self.output = TiedLinear(self.tok_embeddings)
        self.chunks = chunks

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.layer(self.tok_embeddings(tokens))))
        return [self.output(c) for c in h.chunk(self.chunks, dim=1)]


def chunked_token_losses(logits: list, labels):
    """``CEWithChunkedOutputLoss`` without its division: each sequence's summed token loss,
    ``[batch]`` (``ignore_index=-100``)."""
    pieces = labels.chunk(len(logits), dim=1)
    return sum(
        F.cross_entropy(lg.transpose(1, 2), lb, ignore_index=-100, reduction="none").sum(1)
        for lg, lb in zip(logits, pieces, strict=True)
    )


def tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(11, (3, 8), generator=g), torch.randint(11, (3, 8), generator=g)
    labels[0, 5:] = -100  # a padded sequence
    return ids, labels


@pytest.mark.parametrize("chunks", [1, 4])
def test_torchtune_chunked_tied_output_with_gradients_scaled_by_the_token_count(chunks):
    """torchtune's ``full_finetune_single_device`` recipe: over ``gradient_accumulation_steps``
    the loss is the token mean times this micro-batch's token count (a token sum), the counts
    add up, then ``training.scale_grads(model, 1 / num_tokens)``, ``clip_grad_norm_``, AdamW,
    ``zero_grad(set_to_none=True)``. The embedding's weight gets its gradient twice, through the
    embedding and through ``F.linear`` on every chunk: grad1 holds both, row by row summed
    over the micro-batches, against the loop of each sequence's own summed token loss."""
    model = TunedDecoder(chunks).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def loss_fn(out, labels):
        return chunked_token_losses(out, labels).sum()

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            want, num_tokens = None, 0
            for micro in range(2):
                ids, labels = tokens(10 * step + micro)
                got = loop_grad(model, loss_fn, ids, labels)
                want = got if want is None else added(want, got)
                count = (labels != -100).sum()
                token_mean = loss_fn(model(ids), labels) / count
                (token_mean * count).backward()
                num_tokens += int(count)
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():  # training.scale_grads
                p.grad.mul_(1 / num_tokens)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_torchtune_chunked_tied_output_in_the_dp_step(method):
    """The same model's per-sequence losses into ``dp_sgd_step`` (no noise): ``.grad`` is the
    sum of each sequence's gradient clipped to 0.5, its gradient through the embedding and the
    tied projection together, and the norms are the loop's, at every step."""
    model = TunedDecoder(4).double()
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        for step in range(2):
            ids, labels = tokens(step)
            want = loop_grad(model, lambda o, t: chunked_token_losses(o, t).sum(), ids, labels)
            norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
            factors = (0.5 / norms).clamp(max=1.0)
            model.zero_grad()
            got = gradhooks.dp_sgd_step(
                hooks, chunked_token_losses(model(ids), labels), max_norm=0.5,
                noise_multiplier=0.0, reduction="sum", method=method,
            )  # fmt: skip
            assert_close(got, norms, f"step {step}: norms")
            for n, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factors, want[n])
                assert_close(p.grad, clipped, f"step {step}: {n}")
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad


# -- SAM and ASAM: the weights restored through p.data ------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_sam_first_and_second_step_restore_the_weights_through_data(adaptive):
    """The SAM repository's optimizer (davda54/sam): ``first_step`` keeps ``p.data.clone()`` in
    the optimizer's state and moves to ``w + e(w)`` in place (ASAM: ``e`` scaled by ``p²``),
    ``zero_grad``; the second forward and backward; ``second_step`` puts the weights back by
    *assigning* ``p.data = old_p`` (a new tensor under the same parameter), then the base
    optimizer steps. Each pass's grad1 is its own, at the weights it ran at."""
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rho = 0.5 if adaptive else 0.05
    old = {}
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, first pass")
            scale = lambda p: p.pow(2) if adaptive else 1.0  # noqa: E731
            norm = torch.stack([(scale(p) * p.grad).norm() for p in model.parameters()]).norm()
            with torch.no_grad():  # first_step(zero_grad=True)
                for p in model.parameters():
                    old[p] = p.data.clone()
                    p.add_(scale(p) * p.grad * rho / (norm + 1e-12))
            base.zero_grad()
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, second pass")
            for p in model.parameters():  # second_step(zero_grad=True)
                p.data = old[p]
            base.step()
            base.zero_grad()


# -- AdaHessian, GradNorm, a gradient-norm penalty: create_graph=True --------------------------


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_adahessian_hutchinson_products_under_pause_leave_grad1():
    """AdaHessian's loop: ``loss.backward(create_graph=True)``, then Hutchinson's estimate of
    the Hessian's diagonal, ``z * torch.autograd.grad(grads, params, grad_outputs=z)`` with
    Rademacher ``z``, then the step and ``zero_grad(set_to_none=True)`` (which breaks the
    gradient's reference cycle). grad1 of the create_graph backward is the loop's; the
    Hessian-vector products, taken under ``h.paused()`` (they differentiate the gradient),
    leave it so. Not paused, they are refused naming the layer and ``h.paused()``, with grad1
    and the parameters as they were."""
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(5)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward(create_graph=True)
            assert_grad1(model, want, f"step {step}")
            zs = [torch.randint(0, 2, p.shape, generator=g).to(D) * 2 - 1 for p in params]
            grads = [p.grad for p in params]
            if step == 1:
                before = snapshot(model)
                with pytest.raises(gradhooks.UnsupportedError, match=r"'\d' \(Linear\).*h\.paused"):
                    torch.autograd.grad(grads, params, grad_outputs=zs, retain_graph=True)
                assert_grad1(model, want, f"step {step}, after the refused product")
                assert_unchanged(model, before, "the refused product")
            with hooks.paused():
                hvs = torch.autograd.grad(grads, params, grad_outputs=zs)
            assert_grad1(model, want, f"step {step}, after the products")
            with torch.no_grad():
                diag = [z * hv for z, hv in zip(zs, hvs, strict=True)]
                for p, d in zip(params, diag, strict=True):
                    p.grad = p.grad.detach() / (d.abs() + 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


class TwoTasks(nn.Module):
    """A shared trunk whose last layer ``shared`` is GradNorm's ``W``, and two task heads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.shared = nn.Linear(3, 5), nn.Linear(5, 5)
        self.head1, self.head2 = nn.Linear(5, 2), nn.Linear(5, 1)

    def forward(self, x):
        z = torch.tanh(self.shared(torch.tanh(self.trunk(x))))
        return self.head1(z), self.head2(z)


def two_task_batch(seed: int):
    x, y = batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    return x, torch.cat([y[:, None].to(D), torch.randn(4, 1, generator=g, dtype=D)], 1)


def task_losses(out, target):
    return torch.stack(
        [F.cross_entropy(out[0], target[:, 0].long()), F.mse_loss(out[1], target[:, 1:])]
    )


def gradnorm_weights_gradient(model, hooks, weights, losses, initial, alpha=1.5):
    """GradNorm's loss on the task weights (Chen et al., 2018): the norms of each weighted
    task loss's gradient at the shared layer, taken with ``create_graph=True`` (under
    ``h.paused()``: they are no example's gradient), pulled towards their mean times each task's
    relative inverse training rate; its gradient with respect to the weights alone."""
    with hooks.paused():
        norms = torch.stack([
            torch.autograd.grad(weights[i] * losses[i], model.shared.weight,
                                retain_graph=True, create_graph=True)[0].norm()
            for i in range(len(losses))
        ])  # fmt: skip
        rate = losses.detach() / initial
        target = (norms.mean() * (rate / rate.mean()) ** alpha).detach()
        return torch.autograd.grad((norms - target).abs().sum(), weights, retain_graph=True)[0]


def test_gradnorm_task_weights_learned_from_their_gradient_norms():
    """GradNorm's training loop (as in pytorch-grad-norm's ``train.py``): the weighted sum of
    the task losses backwarded first (``retain_graph=True``), then, under ``h.paused()``, the
    norms of each weighted task loss's gradient at the shared layer by
    ``torch.autograd.grad(..., create_graph=True)`` and GradNorm's loss differentiated with
    respect to the task weights alone, written into ``weights.grad``; the step, and the weights
    renormalised to sum to the number of tasks. grad1 is each example's gradient of the
    weighted sum of its own task losses, at every step."""
    model = TwoTasks().double()
    weights = torch.ones(2, dtype=D, requires_grad=True)
    optimizer = torch.optim.SGD([*model.parameters(), weights], lr=0.05)
    initial = None
    with gradhooks.add_hooks(model) as hooks:
        for step in range(3):
            x, target = two_task_batch(step)
            w = weights.detach().clone()
            want = loop_grad(model, lambda out, t, w=w: (w * task_losses(out, t)).sum(), x, target)
            losses = task_losses(model(x), target)
            initial = losses.detach() if initial is None else initial
            optimizer.zero_grad()
            (weights * losses).sum().backward(retain_graph=True)
            assert_grad1(model, want, f"step {step}")
            weights.grad = gradnorm_weights_gradient(model, hooks, weights, losses, initial)
            assert_grad1(model, want, f"step {step}, after GradNorm's derivatives")
            optimizer.step()
            with torch.no_grad():
                weights.mul_(2 / weights.sum())
    assert not torch.equal(weights.detach(), torch.ones(2, dtype=D))


def test_gradnorm_with_the_loss_backwarded_after_the_derivatives_is_refused_saying_how():
    """GradNorm written the other way round: the norms' derivatives first, then the weighted
    task losses' backward. That loss holds no derivative, but it runs through the calls the
    ``create_graph=True`` backwards went through, where the hooks cannot tell it from a loss
    built from those derivatives: refused, naming the layer and saying to run the loss's
    backward first; no grad1 is written and the parameters are as they were."""
    model = TwoTasks().double()
    weights = torch.ones(2, dtype=D, requires_grad=True)
    with gradhooks.add_hooks(model) as hooks:
        x, target = two_task_batch(0)
        losses = task_losses(model(x), target)
        weights.grad = gradnorm_weights_gradient(model, hooks, weights, losses, losses.detach())
        before = snapshot(model)
        with pytest.raises(gradhooks.UnsupportedError, match=r"\(Linear\).*before"):
            (weights * losses).sum().backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    assert_unchanged(model, before, "the refused backward")


def test_a_penalty_on_the_gradients_norm_is_refused_pointing_to_torch_func():
    """A gradient-norm penalty (``loss + λ‖∇θ loss‖²``: "Penalizing Gradient Norm", the AMP
    recipe's gradient penalty): the penalty's gradient runs through the double backward, and
    the batch gradient inside it couples the examples. Refused, naming the layer and pointing
    to torch.func; grad1 is left as the ``create_graph=True`` gradient wrote it (the loss's
    own, with a graph) and the parameters as they were."""
    model = mlp()
    params = list(model.parameters())
    before = snapshot(model)
    with gradhooks.add_hooks(model):
        x, y = batch(0)
        want = loop_grad(model, F.cross_entropy, x, y)
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        with pytest.raises(gradhooks.UnsupportedError, match=r"create_graph=True.*torch\.func"):
            (loss + 0.1 * penalty).backward()
        assert_grad1(model, want, "as the create_graph=True gradient wrote it")
    assert_unchanged(model, before, "the refused backward")


# -- timm's train_one_epoch: NativeScaler, adaptive clipping, soft targets, accum_steps, EMA ---


def unitwise_norm(x):
    """timm's ``unitwise_norm``: the norm of each output unit (row) of a weight, of a bias
    whole."""
    return x.norm() if x.dim() <= 1 else x.norm(dim=tuple(range(1, x.dim())), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor: float, eps: float = 1e-3):
    """timm's ``adaptive_clip_grad`` (AGC, Brock et al., 2021), written into ``.grad`` in place
    with ``p.grad.detach().copy_``."""
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad.detach()
        max_norm = unitwise_norm(p.detach()).clamp(min=eps) * clip_factor
        g_norm = unitwise_norm(g)
        clipped = g * (max_norm / g_norm.clamp(min=1e-6))
        g.copy_(torch.where(g_norm < max_norm, g, clipped))


class NativeScaler:
    """timm's ``NativeScaler``: the scaled loss's backward, and where ``need_update``,
    ``unscale_``, the clipping (``dispatch_clip_grad``, mode ``"agc"`` here), the scaler's step
    and update."""

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu")

    def __call__(self, loss, optimizer, clip_grad, parameters, need_update: bool):
        self._scaler.scale(loss).backward()
        if need_update:
            self._scaler.unscale_(optimizer)
            adaptive_clip_grad(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def get_scale(self) -> float:
        return self._scaler.get_scale()


def soft_target_cross_entropy(out, target):
    """timm's ``SoftTargetCrossEntropy``: ``Σ -target · log_softmax``, averaged over the batch."""
    return torch.sum(-target * F.log_softmax(out, dim=-1), dim=-1).mean()


def mixup(x, y, lam: float, classes: int = 2, smoothing: float = 0.1):
    """timm's ``Mixup`` in ``"batch"`` mode: the batch mixed with itself flipped
    (``x.mul_(lam).add_(x.flip(0).mul_(1 - lam))``, in place) and the label-smoothed one-hot
    targets alike (``mixup_target``)."""
    off, on = smoothing / classes, 1 - smoothing + smoothing / classes
    y1 = torch.full((len(y), classes), off, dtype=D).scatter_(1, y[:, None], on)
    target = y1 * lam + y1.flip(0) * (1 - lam)
    x.mul_(lam).add_(x.flip(0).mul_(1 - lam))
    return x, target


def test_timm_train_one_epoch_native_scaler_agc_soft_targets_accum_steps_and_ema():
    """timm's ``train_one_epoch``: mixup's soft targets with ``SoftTargetCrossEntropy``,
    ``accum_steps=2`` (``loss /= accum_steps``; ``need_update`` at the last), the
    ``NativeScaler`` (its ``GradScaler`` on float64 parameters, scale 2¹⁶) with ``unscale_``
    and adaptive gradient clipping, ``zero_grad`` after an update, and ``ModelEmaV3`` (a deep
    copy, updated by ``torch._foreach_lerp_``). grad1 is what the docs say: the per-example
    gradients of the *scaled* loss, summed over the micro-batches, neither unscaled nor
    clipped (grad1 / scale is the loop's, exactly: the scale is a power of two); the EMA copy
    holds no grad1."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss_scaler, accum_steps = NativeScaler(), 2
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    with gradhooks.add_hooks(model):
        for update in range(3):
            want = None
            for micro in range(accum_steps):
                x, y = batch(10 * update + micro)
                x, target = mixup(x, y, lam=0.7)
                got = loop_grad(model, soft_target_cross_entropy, x, target)
                got = {n: g / accum_steps for n, g in got.items()}
                want = got if want is None else added(want, got)
                scale = loss_scaler.get_scale()
                loss = soft_target_cross_entropy(model(x), target) / accum_steps
                need_update = micro == accum_steps - 1
                loss_scaler(loss, optimizer, 0.01, model.parameters(), need_update)
                for n, p in model.named_parameters():
                    assert_close(p.grad1 / scale, want[n], f"update {update}, micro {micro}: {n}")
            optimizer.zero_grad()
            with torch.no_grad():  # ModelEmaV3.update
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
    assert scale == 2.0**16
    assert not any(hasattr(p, "grad1") for p in ema.parameters())
    x, y = batch(50)
    with torch.no_grad():
        assert ema(x).shape == (4, 2)


# -- timm's Lookahead around a LAMB with gradient centralization -------------------------------


class CentralizedLamb(torch.optim.Optimizer):
    """LAMB (You et al., 2020; timm's ``Lamb``) with gradient centralization (Ranger's,
    ``grad.add_(-grad.mean(dims, keepdim=True))``) and decoupled weight decay written into
    ``.grad`` in place, as such optimizers do, then each layer's step scaled by the trust ratio
    ``‖p‖ / ‖update‖``."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.dim() > 1:
                    grad.add_(-grad.mean(dim=tuple(range(1, grad.dim())), keepdim=True))
                grad.add_(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = state["m"] / (state["v"].sqrt() + group["eps"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update, alpha=-group["lr"] * float(trust))


class Lookahead:
    """timm's ``Lookahead``: every ``k`` steps the slow weights move ``alpha`` of the way to the
    fast ones, which are then set to them (``fast_p.copy_(slow)``)."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2):
        self.base, self.alpha, self.k, self.steps = base, alpha, k, 0
        self.slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]

    def step(self):
        self.base.step()
        self.steps += 1
        if self.steps % self.k == 0:
            with torch.no_grad():
                fast = [p for g in self.base.param_groups for p in g["params"]]
                for p, slow in zip(fast, self.slow, strict=True):
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)

    def zero_grad(self, set_to_none: bool = True):
        self.base.zero_grad(set_to_none=set_to_none)


def test_lookahead_lamb_with_gradient_centralization_and_reduce_lr_on_plateau():
    """A Ranger-style loop: timm's ``Lookahead`` around a LAMB that centralizes the gradient
    and adds the weight decay into ``.grad`` in place, ``zero_grad(set_to_none=False)`` (the
    zeros start grad1 afresh), a validation loss under ``no_grad`` in eval mode between steps
    feeding ``ReduceLROnPlateau``. grad1 is each example's own gradient at every step, never
    centralized or decayed, whatever the optimizer did to ``.grad``."""
    model = mlp()
    base = CentralizedLamb(model.parameters())
    optimizer = Lookahead(base)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(base, factor=0.5, patience=0)
    x_val, y_val = batch(77, n=8)
    with gradhooks.add_hooks(model):
        for step in range(5):
            model.train()
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            optimizer.step()
            assert_grad1(model, want, f"step {step}, after the centralizing step")
            model.eval()
            with torch.no_grad():
                plateau.step(F.cross_entropy(model(x_val), y_val))


# -- Sophia: the Gauss-Newton-Bartlett estimate from sampled labels ----------------------------


def test_sophia_hessian_estimate_from_labels_sampled_every_k_steps():
    """Sophia's ``train_sophiag.py``: the step on the batch (``zero_grad(set_to_none=True)``
    after it), and every ``k`` steps a new forward of the same batch, labels sampled from the
    model's own distribution (``Categorical(logits=...).sample()``), that loss's backward,
    ``update_hessian`` reading ``.grad`` (``β₂·h + (1-β₂)·B·g²``), and ``zero_grad`` again.
    grad1 after each backward is each example's own gradient: of the true labels' loss after
    the training backward, of the sampled labels' loss after the estimate's."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hessian = [torch.zeros_like(p) for p in model.parameters()]
    g = torch.Generator().manual_seed(3)
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 2 == 1:
                logits = model(x)
                probs = F.softmax(logits.detach(), -1)
                sampled = torch.multinomial(probs, 1, generator=g)[:, 0]
                want = loop_grad(model, F.cross_entropy, x, sampled)
                F.cross_entropy(logits, sampled).backward()
                assert_grad1(model, want, f"step {step}, the estimate")
                for h, p in zip(hessian, model.parameters(), strict=True):
                    h.mul_(0.99).addcmul_(p.grad, p.grad, value=0.01 * len(x))
                optimizer.zero_grad(set_to_none=True)


# -- PEFT's recipe: LoRA, enable_input_require_grads, reentrant gradient checkpointing ---------


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (transformers' renamed methods)
def test_lora_with_input_require_grads_and_reentrant_gradient_checkpointing():
    """The PEFT / TRL fine-tuning recipe (``prepare_model_for_kbit_training``'s steps on an
    unquantized model): ``gradient_checkpointing_enable(use_reentrant=True)``,
    ``enable_input_require_grads()`` (a forward hook making the frozen embedding's output
    require grad, so that the reentrant checkpoints have an input that does), LoRA on the
    attention's query and value projections, two micro-batches per step, ``clip_grad_norm_``,
    AdamW. grad1 of every adapter weight is the loop's at every step (the loop backwards each
    example: ``torch.autograd.grad`` would not run the reentrant checkpoints again)."""
    peft = pytest.importorskip("peft")
    from test_real_models import llama, lm_loss, text

    torch.manual_seed(0)
    base = llama().double()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    base.enable_input_require_grads()
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj"])  # fmt: skip
    model = peft.get_peft_model(base, config).train()
    with torch.no_grad():  # (LoRA's B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.01)

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1),
                               reduction="sum")  # fmt: skip

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(2):
            want = None
            for micro in range(2):
                batch = text(3, 5, seed=10 * step + micro)
                ids, labels = batch["input_ids"], batch["labels"]
                got = loop_grad(model, loss_fn, ids, labels)
                want = got if want is None else added(want, got)
                lm_loss(model, batch).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad()


# -- a model used through a method that reshapes between its submodules' calls -----------------


class TextTower(nn.Module):
    """OpenAI CLIP's text side, shrunk: ``encode_text`` (a method, not ``forward``) embeds the
    tokens, adds the position embedding, permutes to sequence-first (``NLD -> LND``) for its
    ``transformer`` submodule, permutes back and pools at the end-of-text token. ``"folded"``: a
    video model's feature extractor instead, which folds the frames into the batch
    (``x.view(B * T, ...)``) for its frame encoder, then averages them. ``"positions"``: the
    positions looked up in an ``nn.Embedding`` by ``torch.arange(T)`` in the method itself."""

    def __init__(self, how: str = "sequence-first"):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.token_embedding = nn.Embedding(11, 6)
        if how == "positions":
            self.positional_embedding = nn.Embedding(5, 6)
        self.transformer = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.ln_final = nn.LayerNorm(6)
        self.head = nn.Linear(6, 2)

    def encode_text(self, text):
        x = self.token_embedding(text)
        if self.how == "folded":  # [B, T, 6] -> [B*T, 6] -> [B, T, 6]
            b, t, d = x.shape
            x = self.transformer(x.reshape(b * t, d)).view(b, t, d)
        elif self.how == "positions":
            x = self.transformer(x + self.positional_embedding(torch.arange(text.shape[1])))
        else:  # NLD -> LND -> NLD
            x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        x = self.ln_final(x)
        return self.head(x[torch.arange(x.shape[0]), text.argmax(dim=-1)])

    def forward(self, text):
        return self.encode_text(text)


@pytest.mark.parametrize("kind", ["sequence-first", "folded", "positions"])
@pytest.mark.parametrize("how", ["forward", "method"])
def test_a_method_that_reshapes_the_batch_between_submodule_calls(how, kind):
    """CLIP's ``model.encode_text(text)`` (and a video model's ``x.view(B * T, ...)``), called
    as its training code calls it, not through ``model(...)``: each submodule call is then a
    forward of its own, its batch read from its own input, and the ``transformer`` gets the
    5 positions (or the 3·5 frames; the position embedding its 5 positions) as its batch.
    Called as ``model(text)``, the forward is
    followed and grad1 is each example's. Called through the method, the layers of one backward
    see batches of different sizes: refused, naming the layers and both sizes, with no grad1
    and the parameters as they were (before, the transformer's grad1 had a row per position,
    in silence)."""
    model = TextTower(kind).double()
    g = torch.Generator().manual_seed(0)
    text, y = torch.randint(11, (3, 5), generator=g), torch.randint(2, (3,), generator=g)
    with gradhooks.add_hooks(model):
        if how == "forward":
            want = loop_grad(model, F.cross_entropy, text, y)
            F.cross_entropy(model(text), y).backward()
            assert_grad1(model, want, "through model(text)")
            return
        before = snapshot(model)
        with pytest.raises(gradhooks.BatchNotFoundError, match="call the model itself") as e:
            F.cross_entropy(model.encode_text(text), y).backward()
        layer, rows = {
            "sequence-first": (r"transformer\.\d' \(Linear", 5),
            "folded": (r"transformer\.\d' \(Linear", 15),
            "positions": (r"positional_embedding' \(Embedding", 5),
        }[kind]
        message = str(e.value)
        assert re.search(rf"'{layer}\), for 'weight', .*for {rows}\b", message)
        assert re.search(r"'(head|token_embedding)' \(\w+\), for 'weight', .*for 3\b", message)
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    assert_unchanged(model, before, "the refused backward")


# -- self-supervised pretraining: DINO's multi-crop student, MAE's masking ---------------------


class Backbone(nn.Module):
    """A convolution, averaged over the image, and a projection: the same for any crop size."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 6)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).mean((2, 3)))


class MultiCropWrapper(nn.Module):
    """DINO's ``MultiCropWrapper``: the crops of each resolution concatenated along the batch
    (``torch.cat(x[start:end])``) for one backbone call each, the outputs concatenated, one
    head call on them all."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = Backbone(), nn.Linear(6, 5)

    def forward(self, x: list):
        sizes = torch.tensor([inp.shape[-1] for inp in x])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, output = 0, torch.empty(0, dtype=x[0].dtype)
        for end in idx_crops:
            output = torch.cat((output, self.backbone(torch.cat(x[start:end]))))
            start = end
        return self.head(output)


def dino_losses(student_out, teacher_out, center, crops: int):
    """DINOLoss: for each global crop's sharpened, centred teacher distribution and each other
    crop of the student, the cross-entropy, averaged over the pairs; one loss per image."""
    student = (student_out / 0.1).chunk(crops)
    teacher = F.softmax((teacher_out - center) / 0.04, dim=-1).detach().chunk(2)
    pairs = [(q, v) for q in range(2) for v in range(crops) if v != q]
    return sum(
        torch.sum(-teacher[q] * F.log_softmax(student[v], dim=-1), dim=-1) for q, v in pairs
    ) / len(pairs)


def test_dino_multi_crop_student_against_an_ema_teacher():
    """DINO's ``train_one_epoch``: 2 global and 3 local crops per image, the teacher (a deep
    copy, no grad) on the global crops, the student on all, through ``MultiCropWrapper``'s
    concatenations; the loss averaged over the images; the student's step, the teacher's EMA
    and the centre's update (from the teacher's batch mean, used at the next step). grad1 is
    each image's own gradient, over all its crops, at every step (the loop runs the student on
    that image's crops alone)."""
    student, b = MultiCropWrapper().double(), 3
    teacher = copy.deepcopy(student).requires_grad_(False)
    center = torch.zeros(1, 5, dtype=D)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    params = list(student.parameters())
    with gradhooks.add_hooks(student):
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            crops = [torch.randn(b, 3, 8, 8, generator=g, dtype=D) for _ in range(2)]
            crops += [torch.randn(b, 3, 4, 4, generator=g, dtype=D) for _ in range(3)]
            with torch.no_grad():
                teacher_out = teacher(crops[:2])
            rows = []
            with gradhooks.paused():
                for i in range(b):
                    own = dino_losses(
                        student([c[i : i + 1] for c in crops]), teacher_out[i::b], center, 5
                    )
                    rows.append(torch.autograd.grad(own.sum(), params))
            want = {n: torch.stack([r[k] for r in rows]) for k, (n, _) in
                    enumerate(student.named_parameters())}  # fmt: skip
            optimizer.zero_grad()
            dino_losses(student(crops), teacher_out, center, 5).mean().backward()
            assert_grad1(student, want, f"step {step}")
            optimizer.step()
            with torch.no_grad():
                for ps, pt in zip(student.parameters(), teacher.parameters(), strict=True):
                    pt.mul_(0.9).add_(ps.detach(), alpha=0.1)
                center = center * 0.9 + teacher_out.mean(0, keepdim=True) * 0.1


class MaskedAutoencoder(nn.Module):
    """MAE's ``MaskedAutoencoderViT``, shrunk: patch embedding, fixed position embedding, the
    ``random_masking`` of 50% of the patches by ``argsort`` of per-example noise and
    ``torch.gather``, the class token (``expand``), an encoder block, the decoder's mask tokens
    (``repeat``) put back in place by ``gather`` with ``ids_restore``, its learned position
    embedding, a decoder block and the pixel prediction. The noise is an input (MAE draws it
    inside), so that the loop can give each example its own."""

    def __init__(self, patches: int = 8, pixels: int = 6, dim: int = 8, ddim: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = nn.Linear(pixels, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim), requires_grad=False)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.norm = nn.LayerNorm(dim)
        self.decoder_embed = nn.Linear(dim, ddim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, ddim) * 0.02)
        self.decoder_pos_embed = nn.Parameter(torch.randn(1, patches + 1, ddim) * 0.1)
        self.decoder_block = nn.Sequential(nn.LayerNorm(ddim), nn.Linear(ddim, ddim), nn.GELU())
        self.decoder_pred = nn.Linear(ddim, pixels)

    @staticmethod
    def random_masking(x, noise, ratio: float = 0.5):
        n, length, d = x.shape
        keep = int(length * (1 - ratio))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x_masked = torch.gather(x, 1, ids_shuffle[:, :keep].unsqueeze(-1).repeat(1, 1, d))
        mask = torch.ones(n, length, dtype=x.dtype)
        mask[:, :keep] = 0
        return x_masked, torch.gather(mask, 1, ids_restore), ids_restore

    def forward(self, patches, noise):
        x = self.patch_embed(patches) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, noise)
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1)
        x = self.norm(x + self.block(x))
        x = self.decoder_embed(x)
        tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        return self.decoder_pred(x + self.decoder_block(x))[:, 1:, :], mask


def mae_loss(out, target):
    """MAE's ``forward_loss`` with ``norm_pix_loss``: each patch's target normalized, the
    squared error averaged over the pixels, then over the masked patches of the batch (as
    many for each example)."""
    pred, mask = out
    mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
    loss = ((pred - (target - mean) / (var + 1e-6) ** 0.5) ** 2).mean(dim=-1)
    return (loss * mask).sum() / mask.sum()


def test_mae_pretraining_with_accumulation_and_weight_decay_groups():
    """MAE's ``engine_pretrain.train_one_epoch``: ``accum_iter=2`` (``loss /= accum_iter``, the
    step and ``zero_grad`` every second iteration), AdamW with ``betas=(0.9, 0.95)`` over
    timm's ``param_groups_weight_decay`` (no decay for the tokens, the position embedding and
    the 1-d parameters), the frozen sin-cos position embedding. grad1 holds each example's own
    gradient, through the gathers and the mask tokens, summed over the micro-batches."""
    model = MaskedAutoencoder().double()
    no_decay = lambda n, p: p.ndim <= 1 or "token" in n or "pos" in n  # noqa: E731
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": 0.05},
         {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}],
        lr=0.01, betas=(0.9, 0.95),
    )  # fmt: skip
    accum_iter, want = 2, None
    with gradhooks.add_hooks(model):
        for it in range(4):
            g = torch.Generator().manual_seed(it)
            patches = torch.randn(3, 8, 6, generator=g, dtype=D)
            noise = torch.rand(3, 8, generator=g, dtype=D)
            got = loop_grad(model, mae_loss, (patches, noise), patches)
            got = {n: w / accum_iter for n, w in got.items()}
            want = got if it % accum_iter == 0 else added(want, got)
            (mae_loss(model(patches, noise), patches) / accum_iter).backward()
            assert_grad1(model, want, f"iteration {it}")
            if (it + 1) % accum_iter == 0:
                optimizer.step()
                optimizer.zero_grad()


# -- Stable-Baselines3's PPO: minibatch epochs over a rollout, a state-independent log_std ---


class ActorCritic(nn.Module):
    """SB3's ``ActorCriticPolicy`` for a continuous action, shrunk: separate policy and value
    MLPs, ``action_net``, ``value_net`` and the state-independent ``log_std`` parameter
    (``DiagGaussianDistribution``: ``std = ones_like(mean) * log_std.exp()``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp_pi, self.mlp_vf = (nn.Sequential(nn.Linear(4, 8), nn.Tanh()) for _ in range(2))
        self.action_net, self.value_net = nn.Linear(8, 2), nn.Linear(8, 1)
        self.log_std = nn.Parameter(torch.zeros(2))

    def evaluate_actions(self, obs, actions):
        mean = self.action_net(self.mlp_pi(obs))
        dist = torch.distributions.Normal(mean, torch.ones_like(mean) * self.log_std.exp())
        values = self.value_net(self.mlp_vf(obs)).flatten()
        return values, dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)

    def forward(self, obs, actions):
        return self.evaluate_actions(obs, actions)


def ppo_losses(out, rollout):
    """PPO's objective per sample: the clipped surrogate, the entropy bonus (0.01) and the
    value loss (0.5); ``rollout`` holds the old log-probability, the advantage (normalized
    over the minibatch, as SB3 does: constants of the loss) and the return."""
    values, log_prob, entropy = out
    old_log_prob, advantages, returns = rollout.unbind(1)
    ratio = torch.exp(log_prob - old_log_prob)
    surrogate = torch.min(advantages * ratio, advantages * torch.clamp(ratio, 0.8, 1.2))
    return -surrogate - 0.01 * entropy + 0.5 * (returns - values) ** 2


def test_ppo_minibatch_epochs_over_a_rollout():
    """SB3's ``PPO.train``: 2 epochs over a rollout of 12 samples in shuffled minibatches of 4,
    the advantages normalized per minibatch, the loss averaged, ``zero_grad``,
    ``clip_grad_norm_(0.5)``, Adam. Through ``policy(obs, actions)``, grad1 of every parameter,
    ``log_std`` included (used outside any layer), is each sample's own. SB3 calls
    ``policy.evaluate_actions`` itself, a method: then ``log_std`` is used outside any captured
    call; the backward warns naming it and gives it no grad1 (the layers' grad1 is right), and
    the DP step refuses to run without it."""
    policy = ActorCritic().double()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3, eps=1e-5)
    g = torch.Generator().manual_seed(0)
    obs, actions = (
        torch.randn(12, 4, generator=g, dtype=D),
        torch.randn(12, 2, generator=g, dtype=D),
    )
    with torch.no_grad():
        old_log_prob = policy.evaluate_actions(obs, actions)[1]
    advantages, returns = (
        torch.randn(12, generator=g, dtype=D),
        torch.randn(12, generator=g, dtype=D),
    )

    def minibatch(idx):
        adv = advantages[idx]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        return obs[idx], actions[idx], torch.stack([old_log_prob[idx], adv, returns[idx]], 1)

    def loss_fn(out, rollout):
        return ppo_losses(out, rollout).mean()

    with gradhooks.add_hooks(policy):
        for epoch in range(2):
            for idx in torch.randperm(12, generator=g).split(4):
                o, a, rollout = minibatch(idx)
                want = loop_grad(policy, loss_fn, (o, a), rollout)
                optimizer.zero_grad()
                loss_fn(policy(o, a), rollout).backward()
                assert_grad1(policy, want, f"epoch {epoch}")
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                optimizer.step()
        o, a, rollout = minibatch(torch.arange(4))
        want = loop_grad(policy, loss_fn, (o, a), rollout)
        optimizer.zero_grad()
        with pytest.warns(gradhooks.GradhooksWarning, match=r"'log_std'.*method of the model"):
            loss_fn(policy.evaluate_actions(o, a), rollout).backward()
        assert not hasattr(policy.log_std, "grad1")
        for n, p in policy.named_parameters():
            if n != "log_std":
                assert_close(p.grad1, want[n], f"through the method: {n}")
    with gradhooks.add_hooks(policy, quantities=("norms",)) as hooks:
        with pytest.warns(gradhooks.GradhooksWarning):
            with pytest.raises(gradhooks.StateError, match=r"'log_std'.*cannot be clipped"):
                losses = ppo_losses(policy.evaluate_actions(o, a), rollout)
                gradhooks.dp_sgd_step(hooks, losses, max_norm=1.0, noise_multiplier=0.0)

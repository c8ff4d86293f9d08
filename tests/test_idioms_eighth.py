"""Published training loops, an eighth set, each step checked against the float64 oracle.

Each test writes again, on a small model, the idioms of one published loop that the earlier
sets do not run: DP training loops that change the trainable layers in the middle of a
logical batch, or keep Opacus' ``BatchMemoryManager`` habit of ``zero_grad()`` before every
physical batch, with :class:`gradhooks.DPOptimizer`; MT-DNN's task batches under DP; the
FixMatch reference code's ``interleave`` / ``de_interleave`` of labelled, weakly and strongly
augmented batches in one forward, with pseudo-labels from the detached weak logits; timm's
``DropPath`` (a per-example mask drawn inside the forward); insightface's ``ArcFace`` margin
head given the labels and building their one-hot inside the forward; a center loss trained by
its own optimizer; a task-conditioned hypernetwork; the original K-FAC code's non-full
``register_backward_hook`` beside the hooks; ``gradhooks.KFAC`` and grad1 in one loop;
torchtune's activation offloading (``saved_tensors_hooks``, ``save_on_cpu``),
``detect_anomaly`` and ``checkpoint_sequential``; DeepSpeech-style CTC on time-major
log-probabilities; elastic weight consolidation (a Fisher from ``grad1``, its penalty on the
next task); multi-task heads picked by the batch's task, by each example's (``torch.where``),
or by a mask of the task ids; the VQ-VAE notebook's EMA codebook, made anew as parameters at
every forward; TRL's DPO with the reference from the PEFT adapter disabled under
``no_grad``; a Lightning GAN in one hooked module, ``toggle_optimizer`` between its steps. Each is compared with each example's own gradient by a per-example loop in
float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out), or checked to stop
with an error that says what went wrong and leaves the model as it was; what is not right
yet is a strict xfail saying why.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_idioms_seventh import assert_unchanged, snapshot, summed_ce
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, cpu_only, mlp

D = torch.float64


def batch(seed: int, n: int = 4):
    """``n`` examples of 3 features and their labels (2 classes), float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def rows_of(model: nn.Module, n: int, loss_of) -> dict[str, torch.Tensor]:
    """The per-example loop written out: ``loss_of(i)`` is example ``i``'s own loss (its
    forward run again, under ``gradhooks.paused()``); each parameter's gradient of it (zeros
    where it got none), row by row. ``.grad`` is put back as it was."""
    params = dict(model.named_parameters())
    kept = {k: p.grad for k, p in params.items()}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    try:
        with gradhooks.paused():
            for i in range(n):
                for p in params.values():
                    p.grad = None
                loss_of(i).backward()
                for k, p in params.items():
                    got[k].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    finally:
        for k, p in params.items():
            p.grad = kept[k]
    return {k: torch.stack(v) for k, v in got.items()}


# -- DP: a layer unfrozen in the middle of a logical batch ---------------------------------------


def _deep() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
        nn.Linear(4, 2),
    ).to(D)  # fmt: skip


@pytest.mark.parametrize("when", ["between physical batches", "before the step"])
def test_dp_optimizer_refuses_a_layer_unfrozen_in_the_middle_of_a_logical_batch(when):
    """A DP fine-tuning loop that unfreezes by the count of physical batches (Opacus'
    ``BatchMemoryManager`` steps are physical): layer 2 joins and its twin, layer 4 (same
    shapes), leaves between the physical batches of one logical batch, or after the last one
    and before ``step()``. The buffer holds clipped sums of the parameters trainable at its
    first backward; before, layer 4's were added to layer 2's gradient without a word (and a
    change of shapes failed inside torch). Refused, naming both layers and their shapes,
    before anything runs: ``.grad``, the parameters and the buffer as they were; after
    ``zero_grad(discard=True)`` the logical batch runs again and the step is that of its
    clipped sums."""
    model = _deep()
    model[2].requires_grad_(False)
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks, max_grad_norm=100.0,
            noise_multiplier=0.0, expected_batch_size=8,
        )  # fmt: skip
        x, y = batch(0)
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        model[2].requires_grad_(True)
        model[4].requires_grad_(False)
        before = snapshot(model)
        x2, y2 = batch(1)
        message = (
            r"DPOptimizer\.(backward|step).*trainable now and not then: '2\.weight' \(4, 4\), "
            r"'2\.bias' \(4,\); trainable then and not now: '4\.weight' \(4, 4\), "
            r"'4\.bias' \(4,\).*zero_grad\(discard=True\)"
        )
        with pytest.raises(gradhooks.StateError, match=message):
            if when == "between physical batches":
                opt.backward(F.cross_entropy(model(x2), y2, reduction="none"))
            else:
                opt.step()
        assert all(p.grad is None for p in model.parameters())
        assert opt.examples == 4
        assert_unchanged(model, before, "the refused call")
        # run again: the step is the mean of the two batches' gradients (none clipped at 100)
        opt.zero_grad(discard=True)
        xs, ys = torch.cat([x, x2]), torch.cat([y, y2])
        want = loop_grad(model, F.cross_entropy, xs, ys)
        for xb, yb in ((x, y), (x2, y2)):
            opt.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        sgd = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert_close(p.grad, want[n].mean(0), f"{n}'s gradient")
                assert_close(p.detach(), sgd[n] - 0.1 * want[n].mean(0), f"{n} stepped")
            else:
                assert p.grad is None and torch.equal(p.detach(), sgd[n]), n


def test_dp_optimizer_zero_grad_before_every_physical_batch_is_refused():
    """Opacus' ``BatchMemoryManager`` loop calls ``optimizer.zero_grad()`` before every
    physical batch (Opacus keeps the summed gradients of a skipped step). Ported to
    ``DPOptimizer`` as it is, each ``zero_grad()`` emptied the buffer, and the step at the
    logical batch's end was of its last physical batch alone, divided by the expected batch
    size, without an error (4 of 8 examples: well within a Poisson batch's spread). Refused
    while the buffer holds a logical batch not stepped yet, saying what the loop must do;
    ``zero_grad(discard=True)`` drops it on purpose; the loop without the call per physical
    batch steps on all of them."""
    model = mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks, max_grad_norm=100.0,
            noise_multiplier=0.0, expected_batch_size=8,
        )  # fmt: skip
        physical = [batch(0), batch(1)]
        opt.zero_grad()  # (an empty buffer: nothing to drop)
        opt.backward(F.cross_entropy(model(physical[0][0]), physical[0][1], reduction="none"))
        message = (
            r"DPOptimizer\.zero_grad: the buffer holds the clipped gradients of 1 physical "
            r"batch\(es\) \(4 examples\).*BatchMemoryManager.*zero_grad\(discard=True\)"
        )
        with pytest.raises(gradhooks.StateError, match=message):
            opt.zero_grad()
        assert opt.examples == 4
        opt.backward(F.cross_entropy(model(physical[1][0]), physical[1][1], reduction="none"))
        xs = torch.cat([x for x, _ in physical])
        ys = torch.cat([y for _, y in physical])
        want = loop_grad(model, F.cross_entropy, xs, ys)
        opt.step()
        for n, p in model.named_parameters():
            assert_close(p.grad, want[n].mean(0), f"{n}: the step of both physical batches")
        opt.zero_grad()  # (after the step: nothing to drop)
        opt.backward(F.cross_entropy(model(physical[0][0]), physical[0][1], reduction="none"))
        opt.zero_grad(discard=True)
        assert opt.examples == 0


# -- FixMatch: interleaved labelled and unlabelled batches, pseudo-labels from the weak view -----


def _interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def _de_interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def test_fixmatch_interleaved_views_with_pseudo_labels_from_the_weak_logits():
    """The FixMatch reference code (kekmodel/FixMatch-pytorch ``train``): the labelled batch,
    the weak and the strong views of ``mu`` times as many unlabelled images are concatenated and
    ``interleave``-d before one forward (so that BatchNorm would see each kind in every
    stretch; here no BatchNorm), the logits ``de_interleave``-d and split; the pseudo-labels
    and the confidence mask come from the *detached* weak logits; the loss is the labelled
    cross-entropy plus the masked cross-entropy of the strong views. Each row of the model's
    input is one example: its grad1 row is the gradient of that row's own term (zero for a
    weak view, whose logits only feed detached targets), in the interleaved order, over steps
    of SGD."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    b, mu = 2, 2
    size = 2 * mu + 1
    kept = 0
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            xl = torch.randn(b, 3, generator=g, dtype=D)
            yl = torch.randint(2, (b,), generator=g)
            weak = torch.randn(mu * b, 3, generator=g, dtype=D)
            strong = weak + 0.5 * torch.randn(mu * b, 3, generator=g, dtype=D)
            inputs = _interleave(torch.cat((xl, weak, strong)), size)
            opt.zero_grad()
            logits = _de_interleave(model(inputs), size)
            lx, (lw, ls) = logits[:b], logits[b:].chunk(2)
            conf, pseudo = torch.softmax(lw.detach(), -1).max(-1)
            mask = conf.ge(0.66).to(D)
            kept += int(mask.sum())
            loss = F.cross_entropy(lx, yl, reduction="sum")
            loss = loss + (F.cross_entropy(ls, pseudo, reduction="none") * mask).sum()
            loss.backward()
            # each input row's own term: the labelled ones, the weak ones (none), the strong
            targets = torch.cat([yl, pseudo, pseudo])
            weights = torch.cat([torch.ones(b, dtype=D), torch.zeros(mu * b, dtype=D), mask])
            at = _de_interleave(torch.arange(len(inputs)), size)  # logits' row j: input at[j]
            row_target, row_weight = torch.empty_like(targets), torch.empty_like(weights)
            row_target[at], row_weight[at] = targets, weights

            def own(i, inputs=inputs, target=row_target, weight=row_weight):
                return F.cross_entropy(model(inputs[i : i + 1]), target[i : i + 1]) * weight[i]

            assert_grad1(model, rows_of(model, len(inputs), own), f"step {step}")
            opt.step()
    assert 0 < kept < 3 * mu * b, "the threshold keeps some pseudo-labels and drops some"


# -- timm's DropPath: a per-example mask drawn inside the forward --------------------------------


class _DropPath(nn.Module):
    """timm's ``drop_path``: ``x.new_empty((B, 1, ...)).bernoulli_(keep).div_(keep)`` times
    ``x``; keeps the last mask, and multiplies by ``replay`` instead where it is set (for the
    per-example loop)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.last, self.replay = p, None, None

    def forward(self, x):
        if self.replay is not None:
            return x * self.replay
        if not self.training or self.p == 0.0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)
        self.last = mask
        return x * mask


class _ResidualBlocks(nn.Module):
    """Two pre-norm residual MLP blocks with stochastic depth (timm's ``Block``), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(2))
        self.fc1 = nn.ModuleList(nn.Linear(4, 6) for _ in range(2))
        self.fc2 = nn.ModuleList(nn.Linear(6, 4) for _ in range(2))
        self.drops = nn.ModuleList(_DropPath(p) for p in (0.3, 0.6))
        self.embed, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x).unsqueeze(1).expand(-1, 2, -1)  # two tokens per example
        for norm, fc1, fc2, drop in zip(self.norms, self.fc1, self.fc2, self.drops, strict=True):
            h = h + drop(fc2(F.gelu(fc1(norm(h)))))
        return self.head(h.mean(1))


def test_timm_drop_path_masks_drawn_in_the_forward_over_steps():
    """timm's stochastic depth in a ViT-like stack (``drop_path_rate`` rising with depth): each
    example's residual branch is kept or dropped by a Bernoulli draw inside the forward, the
    kept ones scaled by ``1 / keep``. Each example's gradient is that of its own draw: the loop
    replays each example's mask. Over steps of AdamW, with some branches dropped."""
    torch.manual_seed(0)
    model = _ResidualBlocks().to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dropped = 0
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = batch(step, 6)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            masks = [d.last for d in model.drops]
            dropped += sum(int((m == 0).sum()) for m in masks)

            def own(i, x=x, y=y, masks=masks):
                for d, m in zip(model.drops, masks, strict=True):
                    d.replay = m[i : i + 1]
                return F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])

            try:
                want = rows_of(model, len(x), own)
            finally:
                for d in model.drops:
                    d.replay = None
            assert_grad1(model, want, f"step {step}")
            opt.step()
    assert dropped, "no branch was dropped"


# -- insightface's ArcFace head, the labels passed to the forward --------------------------------


class _ArcMargin(nn.Module):
    """insightface's ``ArcMarginProduct``: cosines of the normalized features and weights,
    ``cos(θ + m)`` at the label (``torch.where`` past ``π - m``), the one-hot of the labels
    built inside the forward (``torch.zeros(cosine.size())`` then ``scatter_``), scaled."""

    def __init__(self, features: int, classes: int, s: float = 8.0, m: float = 0.5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, features))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros(cosine.size(), dtype=cosine.dtype)
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        return self.s * (one_hot * phi + (1.0 - one_hot) * cosine)


class _FaceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
        self.head = _ArcMargin(4, 3)

    def forward(self, x, label):
        return self.head(self.body(x), label)


def test_arcface_margin_head_given_the_labels_in_the_forward():
    """insightface's recognition loop (``arcface_torch``'s margin head): the backbone's
    features and the labels go into the head, whose weight is normalized (an operation of a
    parameter alone) and whose one-hot is built from the labels inside the forward. The mean
    cross-entropy of the margin logits; grad1 against the loop over steps of SGD with
    momentum, and ``check`` finds the loss a mean."""
    torch.manual_seed(0)
    model = _FaceModel().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 3, generator=g, dtype=D), torch.randint(3, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, (x, y), y)
            opt.zero_grad()
            F.cross_entropy(model(x, y), y).backward()
            assert_grad1(model, want, f"step {step}")
            if step == 0:
                report = hooks.check(lambda out, t: F.cross_entropy(out, t), (x, y), y)
                assert report.ok, report
            opt.step()


# -- a center loss with its own optimizer ---------------------------------------------------------


class _CenterLoss(nn.Module):
    """The center loss (Wen et al., as in the popular ``CenterLoss`` module): half the squared
    distance of each feature to its class's center, the centers a parameter of their own."""

    def __init__(self, classes: int, features: int) -> None:
        super().__init__()
        self.centers = nn.Parameter(torch.randn(classes, features))

    def forward(self, features, labels):
        return 0.5 * (features - self.centers[labels]).pow(2).sum(1)


def test_center_loss_with_its_own_optimizer_both_hooked():
    """The center-loss recipe: ``loss = ce + λ·center_loss(features, labels)``, the model and
    the center-loss module each hooked (two handles), two optimizers, and the centers'
    gradient rescaled by ``1/λ`` before their step (``param.grad.data *= 1 / λ``). Each
    example's gradient is right for the model's parameters and for the centers (only its
    class's row), and stays so after the rescaling, over steps."""
    model = mlp()
    centers = _CenterLoss(3, 2).to(D)
    lam = 0.1
    opts = (torch.optim.SGD(model.parameters(), lr=0.1),
            torch.optim.SGD(centers.parameters(), lr=0.5))  # fmt: skip

    def total(out, labels):
        return summed_ce(out, labels % 2) + lam * centers(out, labels).sum()

    with (
        gradhooks.add_hooks(model, loss_reduction="sum"),
        gradhooks.add_hooks(centers, loss_reduction="sum"),
    ):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 3, generator=g, dtype=D), torch.randint(3, (5,), generator=g)

            def own(i, x=x, y=y):
                return total(model(x[i : i + 1]), y[i : i + 1])

            want_model, want_centers = rows_of(model, len(x), own), rows_of(centers, len(x), own)
            for o in opts:
                o.zero_grad()
            total(model(x), y).backward()
            assert_grad1(model, want_model, f"step {step}")
            assert_grad1(centers, want_centers, f"step {step}: centers")
            for i, label in enumerate(y.tolist()):  # one row of the centers per example
                others = [c for c in range(3) if c != label]
                assert not centers.centers.grad1[i, others].any()
            centers.centers.grad.mul_(1 / lam)
            assert_close(centers.centers.grad1, want_centers["centers"], "after the rescaling")
            for o in opts:
                o.step()


# -- a hypernetwork generating each example's weights from its task id ---------------------------


class _Hyper(nn.Module):
    """A task-conditioned hypernetwork (von Oswald et al.'s continual-learning hypernetwork):
    a task embedding generates the target layer's weight, per example (``torch.bmm``), and a
    shared chunk generated from the first task's embedding row alone (``F.linear`` of a weight
    computed from a parameter: the same for every example)."""

    def __init__(self) -> None:
        super().__init__()
        self.task = nn.Embedding(3, 4)
        self.gen = nn.Linear(4, 2 * 3)
        self.shared = nn.Linear(4, 2 * 3)

    def forward(self, x, task):
        w = self.gen(self.task(task)).view(-1, 2, 3)
        out = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
        return out + F.linear(x, self.shared(self.task.weight[0]).view(2, 3))


def test_hypernetwork_generating_each_examples_weights_from_its_task():
    """The hypernetwork's parameters get each example's gradient through the weights it
    generated for that example, and through the shared chunk every example used; over steps
    of Adam, tasks mixed within the batch."""
    torch.manual_seed(0)
    model = _Hyper().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x, y = batch(step)
            task = torch.tensor([0, 1, 2, 1]).roll(step)
            want = loop_grad(model, summed_ce, (x, task), y)
            opt.zero_grad()
            summed_ce(model(x, task), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- the original K-FAC code's module hooks beside gradhooks' ------------------------------------


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
def test_kfac_non_full_backward_hooks_see_what_they_see_without_gradhooks():
    """alecwangcq/KFAC-Pytorch's ``KFACOptimizer``: a forward pre-hook saves each Linear's input
    (for ``A``), a non-full ``register_backward_hook`` its output-gradient times the batch size
    (for ``G``), and the step preconditions ``.grad`` in place before SGD. With gradhooks on
    the same layers: the hooks fire once per step and see the same tensors as on a twin
    without gradhooks, and grad1 is the raw per-example gradient, which the in-place
    preconditioning of ``.grad`` leaves alone."""
    model = mlp()
    twin = mlp()
    seen: dict[str, list] = {"model": [], "twin": []}
    handles = []
    for key, m in (("model", model), ("twin", twin)):
        for layer in (m[0], m[2]):
            handles.append(layer.register_forward_pre_hook(
                lambda mod, inp, key=key: seen[key].append(("a", inp[0].detach().clone()))
            ))  # fmt: skip
            handles.append(layer.register_backward_hook(
                lambda mod, gin, gout, key=key: seen[key].append(
                    ("g", gout[0].detach() * gout[0].shape[0])
                )
            ))  # fmt: skip
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    try:
        with gradhooks.add_hooks(model):
            for step in range(3):
                x, y = batch(step)
                want = loop_grad(twin, F.cross_entropy, x, y)
                for key in seen:
                    seen[key].clear()
                for m, opt in zip((model, twin), opts, strict=True):
                    opt.zero_grad()
                    F.cross_entropy(m(x), y).backward()
                assert [k for k, _ in seen["model"]] == ["a", "a", "g", "g"]
                for (_, got), (_, w) in zip(seen["model"], seen["twin"], strict=True):
                    assert_close(got, w, f"step {step}: what a hook saw")
                assert_grad1(model, want, f"step {step}")
                for m in (model, twin):  # the preconditioning, in place on .grad
                    for layer in (m[0], m[2]):
                        layer.weight.grad.mul_(0.5).add_(layer.weight.detach(), alpha=0.01)
                assert_grad1(model, want, f"step {step}, after the preconditioning")
                for opt in opts:
                    opt.step()
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    assert_close(p.detach(), q.detach(), f"step {step}: the twins' weights")
    finally:
        for h in handles:
            h.remove()


# -- activation offloading, anomaly detection, checkpoint_sequential ----------------------------


class _Offload(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's ``OffloadActivations`` in miniature: each saved tensor goes to a store
    under a key at the forward and comes back at the backward."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}

        def pack(t):
            key = len(self.store)
            self.store[key] = t.detach().clone()
            return key

        super().__init__(pack, lambda key: self.store.pop(key))


def _step_in(context: str, model: nn.Module, x, y) -> None:
    if context == "offloaded":
        with _Offload():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    elif context == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    elif context == "detect_anomaly":
        with pytest.warns(UserWarning, match="Anomaly Detection"):
            with torch.autograd.detect_anomaly():
                F.cross_entropy(model(x), y).backward()
    else:
        from torch.utils.checkpoint import checkpoint_sequential

        reentrant = context == "checkpoint_sequential reentrant"
        x = x.requires_grad_(reentrant)
        out = checkpoint_sequential(model, 2, x, use_reentrant=reentrant)
        F.cross_entropy(out, y).backward()


@pytest.mark.parametrize(
    "context",
    ["offloaded", "save_on_cpu", "detect_anomaly", "checkpoint_sequential",
     "checkpoint_sequential reentrant"],
)  # fmt: skip
def test_saved_tensors_offloaded_anomaly_mode_and_checkpoint_sequential(context):
    """torchtune's activation offloading (``saved_tensors_hooks`` around the forward: the
    tensors autograd saves go elsewhere and come back at the backward), torch's
    ``save_on_cpu``, a step under ``detect_anomaly`` (a debugging run), and
    ``checkpoint_sequential`` of the model in two segments (both kinds). grad1 against the
    loop over steps of SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)
    ).to(D)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            _step_in(context, model, x, y)
            assert_grad1(model, want, f"{context}, step {step}")
            opt.step()


# -- DeepSpeech-style CTC on time-major log-probabilities, in the DP step ------------------------


class _Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 6, batch_first=True)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


def test_ctc_loss_on_time_major_log_probs_per_utterance_into_the_dp_step():
    """A speech loop (DeepSpeech.pytorch's ``train``): the model's ``[N, T, C]`` logits are
    ``log_softmax``-ed and transposed to ``[T, N, C]`` for ``F.ctc_loss`` with each
    utterance's target length (``zero_infinity=True``). Summed, grad1 is each utterance's own
    CTC gradient; the per-utterance losses (``reduction="none"``) go into ``dp_sgd_step``
    without noise, whose ``.grad`` is the mean of the clipped per-utterance gradients."""
    torch.manual_seed(0)
    model = _Speech().to(D)
    n, t = 4, 8
    lengths = torch.tensor([3, 2, 4, 1])
    frames = torch.full((n,), t, dtype=torch.long)

    def ctc(out, idx, reduction="sum"):
        log_probs = out.log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets[idx], frames[idx], lengths[idx],
                          reduction=reduction, zero_infinity=True)  # fmt: skip

    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(n, t, 3, generator=g, dtype=D)
            targets = torch.randint(1, 5, (n, 4), generator=g)
            want = loop_grad(model, ctc, x, torch.arange(n))
            model.zero_grad()
            ctc(model(x), torch.arange(n)).backward()
            assert_grad1(model, want, f"step {step}")
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        model.zero_grad()
        norms = gradhooks.dp_sgd_step(
            hooks, ctc(model(x), torch.arange(n), reduction="none"), max_norm=1.0,
            noise_multiplier=0.0,
        )  # fmt: skip
        flat = torch.cat([w.flatten(1) for w in want.values()], 1)
        assert_close(norms, flat.norm(dim=1), "the norms")
        factors = (1.0 / flat.norm(dim=1)).clamp(max=1.0)
        for name, p in model.named_parameters():
            clipped = (want[name] * factors.view(-1, *[1] * p.dim())).mean(0)
            assert_close(p.grad, clipped, f"{name}: the DP step's gradient")


# -- elastic weight consolidation: a Fisher from grad1, its penalty on the next task -------------


def _ewc_penalty(model, fisher, anchor):
    return sum((fisher[n] * (p - anchor[n]).pow(2)).sum() for n, p in model.named_parameters())


def test_ewc_fisher_from_grad1_then_its_penalty_added_to_grad_by_hand():
    """The EWC loop (Kirkpatrick et al.; the ``EWC`` class of the continual-learning
    repositories): after task A, the diagonal empirical Fisher is the mean over task A's
    examples of each example's squared gradient (from grad1, where those repositories loop
    over the examples one by one), the weights are anchored, and task B trains on its loss
    plus ``λ/2 Σ F (θ - θ*)²``. The penalty's gradient is no example's: added to ``.grad`` by
    hand after the backward (as guarantees.md says), grad1 stays each example's task-B
    gradient and the steps are those of the penalized loss (a twin trained on it)."""
    model, twin = mlp(), mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    lam = 5.0
    with gradhooks.add_hooks(model) as hooks:
        for step in range(2):  # task A
            x, y = batch(step)
            for m, opt in zip((model, twin), opts, strict=True):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
        xa, ya = batch(10, 8)
        want = loop_grad(twin, F.cross_entropy, xa, ya)
        model.zero_grad()
        F.cross_entropy(model(xa), ya).backward()
        fisher = {n: p.grad1.pow(2).mean(0).detach() for n, p in model.named_parameters()}
        for n in fisher:
            assert_close(fisher[n], want[n].pow(2).mean(0), f"the Fisher of {n}")
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(3):  # task B
            x, y = batch(20 + step)
            x = x + 1.0
            want = loop_grad(model, F.cross_entropy, x, y)
            for opt in opts:
                opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.grad.add_(lam * fisher[n] * (p - anchor[n]))
            penalized = F.cross_entropy(twin(x), y) + lam / 2 * _ewc_penalty(twin, fisher, anchor)
            penalized.backward()
            assert_grad1(model, want, f"task B, step {step}")
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                assert_close(p.grad, q.grad, f"task B, step {step}: the penalized gradient")
            for opt in opts:
                opt.step()
        report = hooks.check(raise_on_error=False)  # (.grad holds the penalty's gradient)
        assert not report.ok and "a term of the loss" in str(report), report


@cpu_only("the spot check between the full checks runs on the CPU alone")
def test_ewc_penalty_ramped_up_in_the_loss_is_refused_at_the_first_step_it_counts():
    """EWC with the penalty kept in the loss and its weight ramped up from 0 (steps 1 and 2
    contribute nothing). From step 3 on the penalty's gradient is no example's: grad1 cannot
    add up to ``.grad``, which the first such backward must say, as the first backward does
    when the penalty counts from the start. The full check runs at the 1st, 2nd and 4th
    backward; the 3rd is the spot check's (on the CPU: some entries of one parameter, in turn):
    a penalty on every parameter shows on whichever it compares."""
    model = mlp()
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    fisher = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(1, 4):
            x, y = batch(step)
            lam = 0.0 if step < 3 else 1.0
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) + lam * _ewc_penalty(model, fisher, anchor)
            if step < 3:
                loss.backward()
                opt.step()
                continue
            with pytest.raises(gradhooks.CheckFailedError, match="does not add up"):
                loss.backward()


# -- multi-task: heads picked by the batch's task, or by each example's ---------------------------


class _MultiTask(nn.Module):
    """A shared trunk and a head per task (``nn.ModuleDict``): the batch's task picks one
    (``forward(x, task="a")``), or each example's task id picks its head's output
    (``torch.where``), or routes its rows to its head (``out[task == t] = head(h[task == t])``)."""

    def __init__(self, routing: str = "batch") -> None:
        super().__init__()
        self.routing = routing
        self.trunk = nn.Linear(3, 5)
        self.heads = nn.ModuleDict({"a": nn.Linear(5, 2), "b": nn.Linear(5, 2)})

    def forward(self, x, task):
        h = torch.tanh(self.trunk(x))
        if self.routing == "batch":
            return self.heads[task](h)
        if self.routing == "where":
            a, b = self.heads["a"](h), self.heads["b"](h)
            return torch.where((task == 0)[:, None], a, b)
        out = h.new_zeros(h.shape[0], 2)
        for t, key in enumerate(("a", "b")):
            mask = task == t
            out[mask] = self.heads[key](h[mask])
        return out


def test_multi_task_batches_of_each_task_accumulated_into_one_step():
    """MT-DNN's loop with gradient accumulation over tasks: each micro-batch is one task's (its
    head picked by name from an ``nn.ModuleDict``), and a step accumulates a batch of task
    ``a`` then one of task ``b`` (and, the next step, two of ``a``: head ``b`` unreached). Each
    head's grad1 is that of the batch that reached it; the trunk's, the sum of both batches'
    rows, as ``.grad``; a head that no batch of the step reached has no grad1, as it has no
    ``.grad``."""
    torch.manual_seed(0)
    model = _MultiTask().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step, tasks in enumerate([("a", "b"), ("a", "a"), ("b", "a")]):
            want: dict[str, torch.Tensor] = {}
            opt.zero_grad()
            for k, task in enumerate(tasks):
                x, y = batch(10 * step + k)
                got = loop_grad(model, summed_ce, (x, task), y)
                for n, w in got.items():
                    if n.startswith("trunk") or n.startswith(f"heads.{task}"):
                        want[n] = want[n] + w if n in want else w
                summed_ce(model(x, task), y).backward()
            for n, p in model.named_parameters():
                if n in want:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
                    assert_close(p.grad1.sum(0), p.grad, f"step {step}: {n} sums to .grad")
                else:
                    assert p.grad is None and not hasattr(p, "grad1"), f"step {step}: {n}"
            opt.step()


@pytest.mark.parametrize(
    "routing, tasks, head, other",
    [("where", [[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]], "b", 0),
     ("mask", [[0, 1, 0, 1], [1, 1, 0, 1], [0, 0, 0, 0]], "a", 1)],
    ids=["torch.where", "a mask of the task ids"],
)  # fmt: skip
def test_multi_task_heads_picked_per_example(routing, tasks, head, other):
    """Each example's task id picks its head: ``torch.where`` over both heads' outputs (both
    run on every example), or its rows routed to its task's head by a boolean mask of the task
    ids (``out[task == t] = heads[t](h[task == t])``, as a mixture of experts routes tokens).
    Each head's grad1 row is the example's own gradient, zero for an example of the other
    task; over steps, with a batch of one task only (with the mask, the other head gets no
    rows). Before, whole examples picked by a mask were refused as mixed across the batch."""
    torch.manual_seed(0)
    model = _MultiTask(routing).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step, task in enumerate(tasks):
            x, y = batch(step)
            task = torch.tensor(task)
            want = loop_grad(model, summed_ce, (x, task), y)
            opt.zero_grad()
            summed_ce(model(x, task), y).backward()
            assert_grad1(model, want, f"step {step}")
            assert not model.heads[head].weight.grad1[task == other].any()
            opt.step()


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_multi_task_rows_routed_by_a_mask_in_the_dp_step(method):
    """The mask-routed heads in ``dp_sgd_step`` by each method: the norms are each example's
    own (trunk and its head), and ``.grad`` is the mean of the clipped gradients."""
    torch.manual_seed(0)
    model = _MultiTask("mask").to(D)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        x, y = batch(0, 6)
        task = torch.tensor([0, 1, 1, 0, 1, 0])
        want = loop_grad(model, summed_ce, (x, task), y)
        norms = gradhooks.dp_sgd_step(
            hooks, F.cross_entropy(model(x, task), y, reduction="none"), max_norm=0.5,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
        own = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
        assert_close(norms, own, "the norms")
        factors = (0.5 / own).clamp(max=1.0)
        for n, p in model.named_parameters():
            clipped = (want[n] * factors.view(-1, *[1] * p.dim())).mean(0)
            assert_close(p.grad, clipped, f"{n}: the DP step's gradient")


class _RoutedByStatistic(nn.Module):
    """Rows routed to one of two heads by a mask ``statistic(feature)`` that is not each
    example's own: compared with a statistic of the batch, or of fixed positions."""

    def __init__(self, statistic) -> None:
        super().__init__()
        self.statistic = statistic
        self.trunk, self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        mask = self.statistic(h[:, 0])
        out = h.new_zeros(h.shape[0], 2)
        out[mask] = self.a(h[mask])
        out[~mask] = self.b(h[~mask])
        return out


@pytest.mark.parametrize(
    "statistic",
    [
        lambda v: v > v.mean(),
        lambda v: v.detach() > v.detach().median(),
        lambda v: torch.tensor([True, False, True, True, False, True]),
    ],
    ids=["mean", "detached median", "fixed positions"],
)
def test_rows_routed_by_a_mask_against_a_statistic_of_the_batch_are_refused(statistic):
    """The same routing by a mask decided across the batch (an example alone would go to
    another head), or by fixed positions in the batch (an example's head depends on where it
    is, not on what it is). Refused at the forward, naming the layer that got the rows;
    nothing written."""
    torch.manual_seed(0)
    model = _RoutedByStatistic(statistic).to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        x, y = batch(0, 6)
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'[ab]' \(Linear\): its input \(\(\d, 5\)\)"
        ):
            summed_ce(model(x), y).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())


# -- VQ-VAE with an EMA codebook that makes its parameters anew at every forward -----------------


class _VectorQuantizerEMA(nn.Module):
    """The ``VectorQuantizerEMA`` of the widely copied VQ-VAE notebook
    (zalandoresearch/pytorch-vq-vae): nearest codes by distances to the codebook, the one-hot
    encodings by ``scatter_``, the commitment loss computed inside (a mean over the whole
    batch), the straight-through estimator, the perplexity of the batch's codes; in training,
    the EMA of the cluster sizes and of the codes' sums, and the codebook made anew as
    ``nn.Parameter``s at every forward (``trainable=False``: made with
    ``requires_grad=False``, the one change that the error below asks for)."""

    def __init__(self, codes: int, dim: int, trainable: bool = True) -> None:
        super().__init__()
        self.codes, self.dim, self.trainable = codes, dim, trainable
        self.commitment, self.decay, self.eps = 0.25, 0.9, 1e-5
        self._embedding = nn.Embedding(codes, dim)
        self._embedding.weight.data.normal_()
        self._embedding.weight.requires_grad_(trainable)
        self.register_buffer("_ema_cluster_size", torch.zeros(codes))
        self._ema_w = nn.Parameter(torch.randn(codes, dim), requires_grad=trainable)

    def forward(self, inputs):
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat = inputs.view(-1, self.dim)
        w = self._embedding.weight
        distances = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        index = distances.argmin(1).unsqueeze(1)
        encodings = torch.zeros(index.shape[0], self.codes, dtype=inputs.dtype)
        encodings.scatter_(1, index, 1)
        quantized = (encodings @ w).view(inputs.shape)
        if self.training:
            size = self._ema_cluster_size * self.decay + (1 - self.decay) * encodings.sum(0)
            n = size.sum()
            self._ema_cluster_size = (size + self.eps) / (n + self.codes * self.eps) * n
            dw = encodings.t() @ flat
            self._ema_w = nn.Parameter(
                self._ema_w * self.decay + (1 - self.decay) * dw, requires_grad=self.trainable
            )
            self._embedding.weight = nn.Parameter(
                self._ema_w / self._ema_cluster_size.unsqueeze(1), requires_grad=self.trainable
            )
        loss = self.commitment * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()
        avg = encodings.mean(0)
        perplexity = torch.exp(-(avg * torch.log(avg + 1e-10)).sum())
        return loss, quantized.permute(0, 3, 1, 2).contiguous(), perplexity


class _VQVAE(nn.Module):
    def __init__(self, trainable: bool = True) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))
        self.vq = _VectorQuantizerEMA(5, 2, trainable)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1)
        )

    def forward(self, x):
        vq_loss, quantized, perplexity = self.vq(self.encoder(x))
        return vq_loss, self.decoder(quantized), perplexity


def _vq_loss(out, x):
    vq_loss, recon, _ = out
    return F.mse_loss(recon, x) + vq_loss


def test_vq_vae_ema_codebook_made_anew_at_each_forward_is_refused_naming_its_parameters():
    """The notebook's loop as published, with ``model.vq.requires_grad_(False)`` before
    training: the first forward makes the codebook anew as trainable ``nn.Parameter``s, so
    from the second step on the quantizer has trainable parameters and the torch.func
    fallback would have to split the commitment loss, a mean over the batch computed inside
    the module, which recomputed one example at a time is not the batch's mean (the codebook
    moves as it runs). Refused at that step's backward, naming the module and both
    parameters as trainable at that backward, and saying how they became so; no grad1
    written by it. (The first step is right: its quantizer had no trainable parameter.)"""
    torch.manual_seed(0)
    model = _VQVAE().to(D)
    model.vq.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        x = torch.randn(4, 1, 5, 5, dtype=D, generator=torch.Generator().manual_seed(0))
        before = copy.deepcopy(model)
        before.vq.eval()
        want = loop_grad(before, _vq_loss, x, x)
        _vq_loss(model(x), x).backward()
        for n, p in model.named_parameters():
            if not n.startswith("vq"):
                assert_close(p.grad1, want[n], f"the first step: {n}")
        opt.step()
        opt.zero_grad()
        kept = {n: p.grad1.clone() for n, p in model.named_parameters() if hasattr(p, "grad1")}
        assert model.vq._ema_w.requires_grad, "made anew, trainable"
        loss = _vq_loss(model(x), x)
        # (the module's commitment loss, recomputed for each example alone, is neither the
        # mean nor the sum of the batch's: the quantizer updates its codebook as it runs)
        message = (
            r"'vq' \(_VectorQuantizerEMA\): output 0, of shape \(\), a number of the whole "
            r"batch.*'_ema_w' \(5, 2\), '_embedding\.weight' \(5, 2\), "
            r"trainable at this backward.*requires_grad=False"
        )
        with pytest.raises(gradhooks.MixedExamplesError, match=message):
            loss.backward()
        for n, p in model.named_parameters():  # (nothing written: what is left, the first's)
            if hasattr(p, "grad1"):
                assert torch.equal(p.grad1, kept[n]), n


def test_vq_vae_ema_codebook_made_untrainable_trains_against_the_loop():
    """The same loop with the codebook made with ``requires_grad=False``: the encoder gets each
    example's gradient of the reconstruction and of the commitment loss (the mean over the
    batch inside the quantizer, whose straight-through estimator passes the decoder's
    gradient on), over steps of Adam, while the EMA updates the codebook from the batch's
    codes. The loop runs on a copy taken before each step's forward, its quantizer in
    ``eval()`` (the codebook that step's forward used, without the update)."""
    torch.manual_seed(0)
    model = _VQVAE(trainable=False).to(D)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            x = torch.randn(4, 1, 5, 5, dtype=D, generator=torch.Generator().manual_seed(step))
            before = copy.deepcopy(model)
            before.vq.eval()
            want = loop_grad(before, _vq_loss, x, x)
            opt.zero_grad()
            _vq_loss(model(x), x).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()
            assert not torch.equal(before.vq._ema_w, model.vq._ema_w), "the EMA moved"


# -- K-FAC and grad1 in one loop ------------------------------------------------------------------


def test_kfac_optimizer_step_on_a_hooked_model_is_refused_saying_how_to_have_both():
    """A loop that keeps grad1 (per-example norms logged, say) and steps ``gradhooks.KFAC``:
    the optimizer's factor update runs a forward and a backward with hooks of its own, which
    cannot come on top of the user's. Refused (before: 'already has gradhooks hooks ... keep
    using the existing handle', about an ``add_hooks`` the loop never called twice), naming
    ``kfac()`` and ``KFAC.step``, the model and the handle, and giving the recipe that works;
    ``.grad``, grad1 and the weights as they were."""
    model = mlp()
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-2)
    with gradhooks.add_hooks(model) as hooks:
        x, y = batch(0, 8)
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        grad1 = [p.grad1.clone() for p in model.parameters()]
        before = snapshot(model)
        message = (
            r"kfac\(\) \(which KFAC\.step calls for new factors\): Sequential is hooked by "
            r"gradhooks\.add_hooks \(Hooks\(2 modules.*quantities=\('grad1', 'kfac'\).*"
            r"h\.kfac_factors\(\).*kfac_precondition"
        )
        with pytest.raises(gradhooks.StateError, match=message):
            opt.step(x)
        assert_unchanged(model, before, "the refused step")
        for p, g, g1 in zip(model.parameters(), grads, grad1, strict=True):
            assert torch.equal(p.grad, g) and torch.equal(p.grad1, g1)
        assert opt.steps == 0 and hooks.accumulated == 1


def test_grad1_and_kfac_factors_of_the_same_backward_precondition_the_step():
    """The recipe the refusal gives: one handle with ``("grad1", "kfac")``; each step's
    backward gives grad1 (against the loop) and the empirical Fisher's factors
    (``h.kfac_factors()``, equal to ``gradhooks.kfac(..., fisher="empirical")`` of the same
    batch), which precondition ``.grad`` (``kfac_precondition``) before SGD; ``h.clear()``
    after the step. The weights follow a twin preconditioned by ``gradhooks.kfac``'s factors,
    and the preconditioning leaves grad1 alone."""
    model, twin = mlp(), mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    with gradhooks.add_hooks(model, quantities=("grad1", "kfac")) as hooks:
        for step in range(3):
            x, y = batch(step, 8)
            want = loop_grad(model, F.cross_entropy, x, y)
            factors_twin = gradhooks.kfac(twin, x, y, fisher="empirical")
            for opt in opts:
                opt.zero_grad()
            for m in (model, twin):
                F.cross_entropy(m(x), y).backward()
            factors = hooks.kfac_factors()
            assert factors.keys() == factors_twin.keys() == {"0.weight", "2.weight"}
            for n, f in factors.items():
                assert_close(f.A, factors_twin[n].A, f"step {step}: A of {n}")
                assert_close(f.G, factors_twin[n].G, f"step {step}: G of {n}")
            gradhooks.kfac_precondition(model, factors, damping=1e-2)
            gradhooks.kfac_precondition(twin, factors_twin, damping=1e-2)
            assert_grad1(model, want, f"step {step}")
            for opt in opts:
                opt.step()
            hooks.clear()
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                assert_close(p.detach(), q.detach(), f"step {step}: the twins' weights")


def test_dp_optimizer_over_task_batches_noises_a_head_no_batch_reached():
    """MT-DNN's task batches under DP: a logical batch of two physical batches, each one task's
    (its head picked by name). The step is the clipped per-example gradients (trunk and the
    reached head together, per example) of both, over the expected batch size; a logical batch
    of task ``a`` alone still noises head ``b`` (whether a head was reached depends on the
    data: without noise there, a step would tell)."""
    torch.manual_seed(0)
    model = _MultiTask().to(D)
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        for sigma in (0.0, 1.0):
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), hooks, max_grad_norm=0.5,
                noise_multiplier=sigma, expected_batch_size=8,
                generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            for step, tasks in enumerate([("a", "b"), ("a", "a")]):
                want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
                for k, task in enumerate(tasks):
                    x, y = batch(10 * step + k)
                    got = loop_grad(model, F.cross_entropy, (x, task), y)
                    norms = torch.cat([g.flatten(1) for g in got.values()], 1).norm(dim=1)
                    factors = (0.5 / norms).clamp(max=1.0)
                    for n, g in got.items():
                        want[n] += (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0)
                    opt.backward(F.cross_entropy(model(x, task), y, reduction="none"))
                opt.step()
                for n, p in model.named_parameters():
                    if sigma == 0.0:
                        assert_close(p.grad, want[n] / 8, f"step {step}: {n}")
                    else:
                        assert p.grad is not None and p.grad.abs().min() > 0, f"{n}: no noise"
                opt.zero_grad()


# -- DPO: the reference by the same model with its adapter disabled, pairs concatenated ----------


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(7, 6), nn.Linear(6, 6), nn.Linear(6, 7)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


class _Pairs(nn.Module):
    """TRL's ``concatenated_forward``, inside the model: the chosen and the rejected sequences
    of each pair in one batch (``torch.cat``), each sequence's summed log-probability of its
    own next tokens, the two halves side by side: ``[pairs, 2]``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, chosen, rejected):
        ids = torch.cat([chosen, rejected])
        logp = self.lm(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp = logp.sum(-1)
        return torch.stack([logp[: len(chosen)], logp[len(chosen) :]], 1)


def _dpo(policy, reference, beta=0.5):
    margin = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    return -F.logsigmoid(beta * margin)


def test_dpo_with_the_reference_from_the_adapter_disabled_under_no_grad():
    """TRL's ``DPOTrainer`` with a PEFT model and no separate reference: the reference
    log-probabilities come from the same hooked model with its LoRA adapter disabled
    (``with model.disable_adapter(), torch.no_grad()``), the policy's from its forward with
    the adapter on; each pair's chosen and rejected sequences go through in one concatenated
    batch. Each pair is one example: grad1 has a row per pair (the halves of the concatenation
    summed), against the per-pair loop over steps of AdamW; the per-pair losses go into
    ``dp_sgd_step`` whose norms are the pairs' own."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lm = peft.get_peft_model(
        _TinyLM().to(D),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj", "head"], lora_dropout=0.0),
    )
    for n, p in lm.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1)  # (zeros at first: no gradient through lora_A)
    model = _Pairs(lm)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            chosen, rejected = (
                torch.randint(7, (4, 5), generator=g),
                torch.randint(7, (4, 5), generator=g),
            )
            with lm.disable_adapter(), torch.no_grad():
                reference = model(chosen, rejected)
            want = loop_grad(model, lambda out, ref: _dpo(out, ref).sum(), (chosen, rejected),
                             reference)  # fmt: skip
            opt.zero_grad()
            _dpo(model(chosen, rejected), reference).sum().backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        losses = _dpo(model(chosen, rejected), reference)
        norms = gradhooks.dp_sgd_step(hooks, losses, max_norm=1.0, noise_multiplier=0.0)
        want = loop_grad(model, lambda out, ref: _dpo(out, ref).sum(), (chosen, rejected),
                         reference)  # fmt: skip
        assert_close(norms, torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1),
                     "the pairs' norms")  # fmt: skip


# -- a Lightning GAN: one hooked module holding both nets, toggle_optimizer between steps --------


def test_gan_in_one_hooked_module_with_lightning_toggle_optimizer():
    """Lightning's GAN example under manual optimization: one module holds the generator and
    the discriminator (hooked once, as a whole), and ``toggle_optimizer`` freezes every
    parameter outside the optimizer about to step (``requires_grad_(False)``) and
    ``untoggle_optimizer`` thaws them. The generator's step backpropagates through the frozen
    discriminator; the discriminator's sums a real and a detached fake batch (example ``i``:
    the pair). Each step's grad1 is right for the toggled net, over three rounds of Adam; the
    frozen net keeps the grad1 of its own last step, as it keeps its ``.grad``."""
    torch.manual_seed(0)
    gan = nn.ModuleDict({
        "G": nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)),
        "D": nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(0.2), nn.Linear(4, 1)),
    }).to(D)  # fmt: skip
    opts = {k: torch.optim.Adam(gan[k].parameters(), lr=1e-2) for k in ("G", "D")}

    def bce(out, target):
        return F.binary_cross_entropy_with_logits(out, target, reduction="sum")

    def toggle(active):
        for n, p in gan.named_parameters():
            p.requires_grad_(n.startswith(active))

    def untoggle():
        for p in gan.parameters():
            p.requires_grad_(True)

    with gradhooks.add_hooks(gan, loss_reduction="sum"):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            z = torch.randn(4, 2, generator=g, dtype=D)
            real = torch.randn(4, 3, generator=g, dtype=D)
            ones, zeros = torch.ones(4, 1, dtype=D), torch.zeros(4, 1, dtype=D)
            toggle("G")

            def g_loss(i, z=z, ones=ones):
                return bce(gan["D"](gan["G"](z[i : i + 1])), ones[i : i + 1])

            want = rows_of(gan, 4, g_loss)
            opts["G"].zero_grad()
            bce(gan["D"](gan["G"](z)), ones).backward()
            assert_grad1(gan, want, f"step {step}, the generator's")
            for n, p in gan.named_parameters():  # (the frozen net's, of its own last step)
                if hasattr(p, "grad1"):
                    assert_close(p.grad1.sum(0), p.grad, f"step {step}: {n} sums to .grad")
            opts["G"].step()
            untoggle()
            toggle("D")
            fake = gan["G"](z).detach()

            def d_loss(i, real=real, fake=fake, ones=ones, zeros=zeros):
                return bce(gan["D"](real[i : i + 1]), ones[i : i + 1]) + bce(
                    gan["D"](fake[i : i + 1]), zeros[i : i + 1]
                )

            want = rows_of(gan, 4, d_loss)
            opts["D"].zero_grad()
            (bce(gan["D"](real), ones) + bce(gan["D"](fake), zeros)).backward()
            assert_grad1(gan, want, f"step {step}, the discriminator's")
            for n, p in gan.named_parameters():
                if hasattr(p, "grad1"):
                    assert_close(p.grad1.sum(0), p.grad, f"step {step}: {n} sums to .grad")
            opts["D"].step()
            untoggle()

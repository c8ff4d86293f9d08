"""Published scripts whose point is a per-example quantity, a third set, rewritten small, each
step checked against the float64 per-example loop.

As in ``test_real_scripts.py`` and ``test_real_scripts_second.py``: each test follows one script
of a public repository (cited in its docstring: repository and path), its model and its loop as
written there, at tiny sizes, on synthetic data, in float64. These scripts train or score with
each example's own gradient: data pruning scores (GraNd, data_diet's logit-Jacobian scores),
active learning's gradient embeddings (BADGE, BAIT), coreset selection (CORDS' GradMatch and
GLISTER), gradient-norm out-of-distribution scores, and DP-SGD over accumulated mini-batches
(Handcrafted-DP, private_vision) or full batches (DP-RAFT). Where the script computes the
quantity in closed form (the last layer's gradient as the outer product of its output-gradient
and its input), the test compares gradhooks' ``grad1`` with that closed form and with the
per-example loop (:func:`gradhooks.oracle.loop_grad`, or a loop written out where the loss is
not a plain mean); where the script's model has no per-example gradient as written, the test
checks that gradhooks refuses with an error naming the module and leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    one_thread,  # noqa: F401 (autouse in this module)
)

D = torch.float64


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_untouched(model, before: dict, what: str) -> None:
    """No parameter holds a ``grad1`` after a refusal, and every parameter is as it was."""
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), f"{what}: {n} kept a grad1"
        assert torch.equal(p.detach(), before[n]), f"{what}: {n} changed"


# -- JordanAsh/badge query_strategies/strategy.py, run.py ------------------------------------------


class BadgeMLP(nn.Module):
    """JordanAsh/badge ``run.py``'s ``mlpMod``: flatten, ``lm1``, ReLU (the embedding), ``lm2``;
    the forward returns ``(out, emb)``."""

    def __init__(self, dim: int, emb_size: int, n_classes: int) -> None:
        super().__init__()
        self.emb_size = emb_size
        self.dim = dim
        self.lm1 = nn.Linear(dim, emb_size)
        self.lm2 = nn.Linear(emb_size, n_classes)

    def forward(self, x):
        x = x.view(-1, self.dim)
        emb = F.relu(self.lm1(x))
        out = self.lm2(emb)
        return out, emb

    def get_embedding_dim(self) -> int:
        return self.emb_size


class BaitLinear(nn.Module):
    """JordanAsh/badge ``run.py``'s ``linMod``: one Linear on the flattened input, which is also
    the embedding the forward returns."""

    def __init__(self, dim: int, n_classes: int) -> None:
        super().__init__()
        self.dim = dim
        self.lm = nn.Linear(dim, n_classes)

    def forward(self, x):
        x = x.view(-1, self.dim)
        return self.lm(x), x

    def get_embedding_dim(self) -> int:
        return self.dim


def badge_closed_form(cout: torch.Tensor, emb: torch.Tensor, label_of) -> torch.Tensor:
    """``strategy.py``'s ``get_grad_embedding`` loop, written out: block ``c`` of example ``j``
    is ``emb[j] * (1 - p[j, c])`` for ``c == label_of(j)``, else ``emb[j] * -p[j, c]``."""
    probs = F.softmax(cout, dim=1)
    n, n_lab = probs.shape
    dim = emb.shape[1]
    embedding = torch.zeros(n, dim * n_lab, dtype=emb.dtype)
    for j in range(n):
        for c in range(n_lab):
            coef = (1 - probs[j, c]) if c == label_of(j) else (-1 * probs[j, c])
            embedding[j, dim * c : dim * (c + 1)] = emb[j] * coef
    return embedding


def test_badge_trains_with_clamped_gradients_then_embeds_the_predicted_labels_gradient():
    """JordanAsh/badge ``query_strategies/strategy.py``: ``_train`` (Adam, cross-entropy, every
    ``.grad`` clamped to ``[-0.1, 0.1]`` before the step) on the ``mlpMod`` of ``run.py``, which
    returns ``(out, emb)``; then ``get_grad_embedding`` in eval mode: each unlabelled example's
    last-layer gradient of the cross-entropy with its *predicted* label, which the script
    writes in closed form as ``(onehot(pred) - p) ⊗ emb`` (minus the gradient), and
    ``badge_sampling.py``'s k-means++ seeding starts at the embedding of largest norm.
    ``grad1`` at every training step against the per-example loop; the embedding from ``grad1``
    of ``lm2.weight`` (and its norms, without forming it) against the closed form and the loop.
    """
    torch.manual_seed(0)
    model = BadgeMLP(dim=6, emb_size=5, n_classes=3).to(D)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0)
    g = torch.Generator().manual_seed(0)
    x_lab, y_lab = torch.randn(12, 2, 3, generator=g, dtype=D), torch.randint(3, (12,), generator=g)
    x_pool = torch.randn(7, 2, 3, generator=g, dtype=D)
    with gradhooks.add_hooks(model) as hooks:
        model.train()
        for step, idxs in enumerate(torch.randperm(12, generator=g).split(4)):
            x, y = x_lab[idxs], y_lab[idxs]
            optimizer.zero_grad()
            out, e1 = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            want = loop_grad(model, lambda o, t: F.cross_entropy(o[0], t), x, y)
            assert_grad1(model, want, f"step {step}")
            for p in filter(lambda p: p.grad is not None, model.parameters()):
                p.grad.data.clamp_(min=-0.1, max=0.1)
            optimizer.step()

        model.eval()
        optimizer.zero_grad()
        hooks.loss_reduction = "sum"  # (the query's loss is a sum over the pool)
        cout, out = model(x_pool)
        pred = cout.argmax(1).detach()
        F.cross_entropy(cout, pred, reduction="sum").backward()
        got = -model.lm2.weight.grad1.flatten(1)
    with torch.no_grad():
        cout, out = model(x_pool)
        want = badge_closed_form(cout, out, lambda j: pred[j])
    assert_close(got, want, "BADGE's gradient embedding")
    rows = loop_grad(model, lambda o, t: F.cross_entropy(o[0], t, reduction="sum"), x_pool, pred)
    assert_close(got, -rows["lm2.weight"].flatten(1), "BADGE's embedding by the loop")

    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as hooks:
        cout, _ = model(x_pool)
        F.cross_entropy(cout, cout.argmax(1), reduction="sum").backward()
        norms = hooks.param_norms()["lm2.weight"]
    assert_close(norms, want.norm(dim=1), "the embeddings' norms, not formed")
    assert norms.argmax() == want.norm(dim=1).argmax()  # k-means++'s first center


@pytest.mark.parametrize("how", ["backward", "autograd_grad"])
def test_bait_fisher_embeddings_one_backward_per_class(how):
    """JordanAsh/badge ``query_strategies/strategy.py``'s ``get_exp_grad_embedding`` (BAIT,
    ``bait_sampling.py``) on ``run.py``'s ``linMod``, whose embedding is the flattened input:
    for each class ``c``, each example's last-layer gradient of the cross-entropy with label
    ``c`` weighted by ``sqrt(p_c)``, ``[n, n_classes, emb_dim * n_classes]``. Here one hooked
    backward per class of ``Σ_j sqrt(p_jc) · CE(out_j, c)`` (the weights detached), ``grad1``
    read before the next: a forward and ``backward()`` per class after ``zero_grad()``, or one
    forward and a ``torch.autograd.grad`` per class (``retain_graph``), which adds to ``grad1``
    over the backwards of one forward (as K-FAC's sampled labels want) unless
    ``hooks.clear()`` starts each afresh; against the script's closed form and the Fisher
    matrix BAIT sums from it."""
    torch.manual_seed(1)
    model = BaitLinear(dim=4, n_classes=3).to(D).eval()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=D)
    n_lab = 3
    got = torch.zeros(6, n_lab, 4 * n_lab, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        cout, _ = model(x)
        losses = []
        for ind in range(n_lab):
            if how == "backward":
                model.zero_grad()
                cout, _ = model(x)
            weight = F.softmax(cout, dim=1)[:, ind].detach().sqrt()
            target = torch.full((6,), ind)
            losses.append((weight * F.cross_entropy(cout, target, reduction="none")).sum())
            if how == "backward":
                losses[-1].backward()
            else:
                hooks.clear()
                torch.autograd.grad(losses[-1], list(model.parameters()), retain_graph=True)
            got[:, ind] = -model.lm.weight.grad1.flatten(1)
        if how == "autograd_grad":  # without clear(), the classes' rows add up
            hooks.clear()
            for loss in losses:
                torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            assert_close(-model.lm.weight.grad1.flatten(1), got.sum(1), "grad1 accumulated")
    with torch.no_grad():
        cout, out = model(x)
        probs = F.softmax(cout, dim=1)
        want = torch.stack(
            [badge_closed_form(cout, out, lambda j, c=c: c) * probs[:, c : c + 1].sqrt()
             for c in range(n_lab)], 1,
        )  # fmt: skip
    assert_close(got, want, "BAIT's Fisher embeddings")
    assert_close(
        torch.einsum("ncd,nce->de", got, got) / 6,
        torch.einsum("ncd,nce->de", want, want) / 6,
        "BAIT's Fisher matrix",
    )


# -- decile-team/cords cords/selectionstrategies/SL/, cords/utils/models/, train_sl.py ------------


class CordsBlock(nn.Module):
    """``cords/utils/models/resnet.py``'s ``BasicBlock``."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class CordsResNet(nn.Module):
    """``cords/utils/models/resnet.py``'s ``ResNet`` (one ``BasicBlock`` per stage, 64-512
    planes shrunk to 2-16): ``forward(x, last, freeze)`` runs the body under ``no_grad`` when
    ``freeze`` and returns ``(out, embedding)`` when ``last``."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.in_planes = 2
        self.embDim = 8 * self.in_planes
        self.conv1 = nn.Conv2d(3, 2, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(2)
        self.layer1 = self._make_layer(2, 1)
        self.layer2 = self._make_layer(4, 2)
        self.layer3 = self._make_layer(8, 2)
        self.layer4 = self._make_layer(16, 2)
        self.linear = nn.Linear(16, num_classes)

    def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
        block = CordsBlock(self.in_planes, planes, stride)
        self.in_planes = planes
        return nn.Sequential(block)

    def body(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)
        return out.view(out.size(0), -1)

    def forward(self, x, last=False, freeze=False):
        if freeze:
            with torch.no_grad():
                e = self.body(x)
        else:
            e = self.body(x)
        out = self.linear(e)
        return (out, e) if last else out

    def get_embedding_dim(self) -> int:
        return self.embDim


def cords_closed_form(l0_grads: torch.Tensor, l1: torch.Tensor, num_classes: int):
    """``dataselectionstrategy.py``'s ``compute_gradients`` with ``linear_layer=True``: the
    bias gradients, then the weight's, ``repeat_interleave(l0, embDim) * l1.repeat(1, C)``."""
    emb_dim = l1.shape[1]
    l0_expand = torch.repeat_interleave(l0_grads, emb_dim, dim=1)
    l1_grads = l0_expand * l1.repeat(1, num_classes)
    return torch.cat((l0_grads, l1_grads), dim=1)


def test_cords_compute_gradients_of_a_frozen_resnet_body():
    """decile-team/cords ``cords/selectionstrategies/SL/dataselectionstrategy.py``'s
    ``compute_gradients`` on ``cords/utils/models/resnet.py``: ``model(inputs, last=True,
    freeze=True)`` (the body under ``no_grad``), ``CrossEntropyLoss(reduction='none')`` summed,
    the closed-form last-layer gradients from ``torch.autograd.grad(loss, out)`` (a backward
    that reaches no parameter, on the hooked model), then GradMatch's ``sum_val_grad`` and its
    ``PerBatch`` mean. In eval mode, ``grad1`` of the Linear is that closed form, and its sum
    the batch gradient. In train mode (where ``train_sl.py``'s selection runs, inside the
    epoch after ``model.train()``) the embedding holds batch statistics: refused naming the
    Linear and the first batch norm that mixed the examples (one of ten), with no ``grad1``
    and the parameters as they were."""
    torch.manual_seed(0)
    model = CordsResNet(num_classes=3).to(D)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 32, 32, generator=g, dtype=D), torch.randint(3, (6,), generator=g)
    criterion_nored = nn.CrossEntropyLoss(reduction="none")
    with torch.no_grad():  # running statistics of a trained model
        for _ in range(2):
            model.train()(torch.randn(6, 3, 32, 32, generator=g, dtype=D))

    before = snapshot(model)
    model.train()
    with pytest.raises(gradhooks.MixedExamplesError, match=r"'linear'.*batch_norm in 'bn1'"):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            out, l1 = model(x, last=True, freeze=True)
            criterion_nored(out, y).sum().backward()
    assert_untouched(model, before, "train mode")

    model.eval()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out, l1 = model(x, last=True, freeze=True)
        loss = criterion_nored(out, y).sum()
        l0_grads = torch.autograd.grad(loss, out, retain_graph=True)[0]
        assert not hasattr(model.linear.weight, "grad1")
        want = cords_closed_form(l0_grads, l1, 3)
        loss.backward()
        got = torch.cat((model.linear.bias.grad1, model.linear.weight.grad1.flatten(1)), dim=1)
    assert_close(got, want, "grads_per_elem")
    rows = loop_grad(
        model, lambda o, t: criterion_nored(o, t).sum(), (x, False, True), y
    )  # (forward(x, last=False, freeze=True))
    assert_close(got, torch.cat((rows["linear.bias"], rows["linear.weight"].flatten(1)), 1), "loop")
    batch_grad = torch.cat((model.linear.bias.grad, model.linear.weight.grad.flatten()))
    assert_close(got.sum(0), batch_grad, "sum_val_grad")
    assert_close(got.mean(0), want.mean(dim=0), "PerBatch")
    for n in ("conv1.weight", "bn1.weight", "layer1.0.conv1.weight"):
        assert model.get_parameter(n).grad is None, n


class BadgeResNet(CordsResNet):
    """JordanAsh/badge ``resnet.py``'s ``ResNet`` (kuangliu's CIFAR ResNet, as CORDS' above):
    the forward returns ``(out, emb)``."""

    def forward(self, x):
        emb = self.body(x)
        return self.linear(emb), emb


def test_badge_sample_net_refits_batch_norm_on_a_copy_of_the_hooked_classifier():
    """JordanAsh/badge ``query_strategies/strategy.py``'s ``sampleNet``: ``getNet`` deep-copies
    the classifier and sets each parameter's ``.data`` to a sampled weight vector, then
    ``fitBatchnorm`` runs the copy in train mode over the labelled data (forwards with the
    graph recorded, no backward) to refit its running statistics, and ``predict_prob`` runs it
    under ``no_grad``. On ``resnet.py``'s ResNet with the classifier hooked (for the gradient
    embeddings, in eval mode): the copy is not hooked and refits as an unhooked one does; the
    same refit on the hooked classifier itself is refused at its first batch norm, naming it
    and how to run such a forward (``torch.no_grad()``), its running statistics untouched; so
    run, it refits exactly; the gradient embeddings before and after against the closed form.
    """
    torch.manual_seed(0)
    clf = BadgeResNet(num_classes=3).to(D)
    g = torch.Generator().manual_seed(0)
    x_lab = torch.randn(6, 3, 32, 32, generator=g, dtype=D)
    x_pool = torch.randn(5, 3, 32, 32, generator=g, dtype=D)
    with torch.no_grad():
        clf.train()(x_lab)
    twin = copy.deepcopy(clf)  # (never hooked)

    def fit_batchnorm(model):
        for x in x_lab.split(3):
            model(x)
        return model

    def embedding_matches(what):
        clf.eval()
        clf.zero_grad()
        cout, _ = clf(x_pool)
        pred = cout.argmax(1).detach()
        F.cross_entropy(cout, pred, reduction="sum").backward()
        with torch.no_grad():
            want = badge_closed_form(*clf(x_pool), lambda j: pred[j])
        assert_close(-clf.linear.weight.grad1.flatten(1), want, what)

    with gradhooks.add_hooks(clf, loss_reduction="sum"):
        embedding_matches("before")
        flat = torch.cat([p.detach().flatten() for p in clf.parameters()])
        flat = flat + 0.05 * torch.randn(flat.shape, generator=g, dtype=D)
        copied = copy.deepcopy(clf)
        for net in (copied, twin):  # getNet, then fitBatchnorm
            i = 0
            for p in net.parameters():
                p.data = flat[i : i + p.numel()].view(p.size())
                i += p.numel()
            fit_batchnorm(net.train())
        for (n, b), t in zip(copied.named_buffers(), twin.buffers()):
            assert torch.equal(b, t), f"the copy's {n}"
        with torch.no_grad():
            probs = F.softmax(copied.eval()(x_pool)[0], dim=1)
            assert_close(probs, F.softmax(twin.eval()(x_pool)[0], dim=1), "predict_prob")
        assert not any(hasattr(p, "grad1") for p in copied.parameters())

        before = {n: b.clone() for n, b in clf.named_buffers()}
        twin.load_state_dict(clf.state_dict())
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'bn1'.*torch\.no_grad\(\)"):
            fit_batchnorm(clf.train())
        for n, b in clf.named_buffers():
            assert torch.equal(b, before[n]), n
        with torch.no_grad():
            fit_batchnorm(clf.train())
            fit_batchnorm(twin.train())
        for (n, b), t in zip(clf.named_buffers(), twin.buffers()):
            assert torch.equal(b, t), n
        embedding_matches("after the refit")


class TwoLayerNet(nn.Module):
    """``cords/utils/models/simpleNN_net.py``'s ``TwoLayerNet``, ``forward(x, last, freeze)``."""

    def __init__(self, input_dim: int, num_classes: int, hidden_units: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(input_dim, hidden_units)
        self.linear2 = nn.Linear(hidden_units, num_classes)
        self.feature_dim = hidden_units

    def forward(self, x, last=False, freeze=False):
        if freeze:
            with torch.no_grad():
                l1scores = F.relu(self.linear1(x))
        else:
            l1scores = F.relu(self.linear1(x))
        scores = self.linear2(l1scores)
        return (scores, l1scores) if last else scores

    def get_embedding_dim(self) -> int:
        return self.feature_dim


def omp_positive(a: torch.Tensor, b: torch.Tensor, nnz: int):
    """Orthogonal matching pursuit of ``b`` by ``nnz`` columns of ``a`` (``[d, n]``), the
    weights least squares clamped at zero: the role of ``helpers/omp_solvers.py``'s
    ``OrthogonalMP_REG(positive=True)``, not its code."""
    chosen: list[int] = []
    residual = b.clone()
    for _ in range(nnz):
        corr = a.T @ residual
        corr[chosen] = -float("inf")
        chosen.append(int(corr.argmax()))
        w = torch.linalg.lstsq(a[:, chosen], b.unsqueeze(1)).solution.squeeze(1)
        residual = b - a[:, chosen] @ w
    return chosen, w.clamp(min=0)


def test_cords_gradmatch_and_glister_selection_then_weighted_subset_training():
    """decile-team/cords ``train_sl.py`` with GradMatch (``gradmatchstrategy.py``, ``valid=True``)
    on ``simpleNN_net.py``'s ``TwoLayerNet``: at each epoch's start, inside ``model.train()``, the
    training and validation examples' last-layer gradients (``model(x, last=True, freeze=True)``:
    the first Linear called under ``no_grad``, on the hooked model) from ``grad1``; a positive
    OMP of the validation gradient's sum picks the subset and its weights ``gammas``; GLISTER's
    Taylor gains (``glisterstrategy.py``: ``grads_per_elem @ grads_val_curr``) rank the same
    gradients. Then SGD (momentum, weight decay, cosine annealing) on the subset with the loss
    ``torch.dot(losses, weights / weights.sum())``: ``grad1[i]`` is ``w_i / Σw`` times example
    ``i``'s gradient, against the per-example loop at every step; the selection's gradients
    against the script's closed form."""
    torch.manual_seed(0)
    model = TwoLayerNet(input_dim=5, num_classes=3, hidden_units=4).to(D)
    g = torch.Generator().manual_seed(0)
    x_trn, y_trn = torch.randn(10, 5, generator=g, dtype=D), torch.randint(3, (10,), generator=g)
    x_val, y_val = torch.randn(6, 5, generator=g, dtype=D), torch.randint(3, (6,), generator=g)
    criterion_nored = nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2)

    def last_layer_grads(x, y):
        model.zero_grad()
        out, l1 = model(x, last=True, freeze=True)
        loss = criterion_nored(out, y).sum()
        closed = cords_closed_form(torch.autograd.grad(loss, out, retain_graph=True)[0], l1, 3)
        loss.backward()
        got = torch.cat((model.linear2.bias.grad1, model.linear2.weight.grad1.flatten(1)), 1)
        assert_close(got, closed, "grads_per_elem")
        assert model.linear1.weight.grad is None
        return got

    steps = 0
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for epoch in range(2):
            model.train()
            trn_gradients = last_layer_grads(x_trn, y_trn)
            sum_val_grad = last_layer_grads(x_val, y_val).sum(0)
            idxs, gammas = omp_positive(trn_gradients.T, sum_val_grad, nnz=4)
            gains = trn_gradients @ (sum_val_grad / 6).view(-1, 1)
            assert int(gains.argmax()) == idxs[0]  # the first pick of either
            gammas = gammas + 0.1  # (none zero, as the loader's random fill would not be)
            for batch in (idxs[:2], idxs[2:]):
                inputs, targets = x_trn[batch], y_trn[batch]
                weights = gammas[[idxs.index(i) for i in batch]]
                optimizer.zero_grad()
                outputs = model(inputs)
                losses = criterion_nored(outputs, targets)
                loss = torch.dot(losses, weights / (weights.sum()))
                loss.backward()
                rows = loop_grad(model, lambda o, t: criterion_nored(o, t).sum(), inputs, targets)
                scale = weights / weights.sum()
                want = {n: torch.einsum("b,b...->b...", scale, r) for n, r in rows.items()}
                assert_grad1(model, want, f"epoch {epoch} batch {batch}")
                optimizer.step()
                steps += 1
            scheduler.step()
    assert steps == 4


def facility_location(sim: torch.Tensor, k: int) -> list[int]:
    """Naive greedy facility location on a similarity matrix (rows: candidates): the role of
    apricot's ``FacilityLocationSelection(metric="precomputed")``, not its code."""
    chosen: list[int] = []
    best = torch.zeros(sim.shape[1], dtype=sim.dtype)
    for _ in range(k):
        gains = torch.clamp(sim - best, min=0).sum(1)
        gains[chosen] = -1.0
        chosen.append(int(gains.argmax()))
        best = torch.maximum(best, sim[chosen[-1]])
    return chosen


def test_cords_craig_per_class_facility_location_on_gradient_distances():
    """decile-team/cords ``cords/selectionstrategies/SL/craigstrategy.py`` (CRAIG,
    ``selection_type="PerClass"``, ``if_convex=False``): per class, ``compute_score`` takes the
    examples' last-layer gradients (``model(inputs, freeze=True, last=True)``, the closed form),
    their squared distances, ``dist_mat = max - distance``; facility location picks the subset
    and ``compute_gamma`` weighs each pick by how many examples are closest to it; then
    ``train_sl.py`` steps on ``torch.dot(losses, weights / weights.sum())``. Here the gradients
    from ``grad1`` of ``simpleNN_net.py``'s ``TwoLayerNet``: the distance matrix against the
    closed form's, the same picks and gammas, and ``grad1`` of the weighted step against the
    per-example loop."""
    torch.manual_seed(0)
    model = TwoLayerNet(input_dim=5, num_classes=2, hidden_units=4).to(D)
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(12, 5, generator=g, dtype=D), torch.randint(2, (12,), generator=g)
    criterion_nored = nn.CrossEntropyLoss(reduction="none")
    greedy, gammas = [], []
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for c in range(2):
            idxs = torch.where(labels == c)[0]
            model.zero_grad()
            out, l1 = model(x[idxs], freeze=True, last=True)
            loss = criterion_nored(out, labels[idxs]).sum()
            closed = cords_closed_form(torch.autograd.grad(loss, out, retain_graph=True)[0], l1, 2)
            loss.backward()
            g_is = torch.cat((model.linear2.bias.grad1, model.linear2.weight.grad1.flatten(1)), 1)
            dist = torch.cdist(g_is, g_is) ** 2
            want = torch.pow(closed.unsqueeze(1) - closed.unsqueeze(0), 2).sum(2)
            assert_close(dist, want, f"class {c}: distances")
            sim, want_sim = dist.max() - dist, want.max() - want
            picks = facility_location(sim, k=2)
            assert picks == facility_location(want_sim, k=2), f"class {c}"
            rep = sim[picks].argmax(0)
            assert torch.equal(rep, want_sim[picks].argmax(0)), f"class {c}"
            greedy += idxs[picks].tolist()
            gammas += torch.bincount(rep, minlength=2).tolist()

        weights = torch.tensor(gammas, dtype=D)
        inputs, targets = x[greedy], labels[greedy]
        model.zero_grad()
        losses = criterion_nored(model(inputs), targets)
        torch.dot(losses, weights / weights.sum()).backward()
        rows = loop_grad(model, lambda o, t: criterion_nored(o, t).sum(), inputs, targets)
        want = {
            n: torch.einsum("b,b...->b...", weights / weights.sum(), r) for n, r in rows.items()
        }
        assert_grad1(model, want, "the weighted step")


class CordsLSTM(nn.Module):
    """``cords/utils/models/lstm.py``'s ``LSTM``: the four gates' ``U``, ``V`` and ``b`` as bare
    ``nn.Parameter``s used with ``@`` in a loop over time (no rule: the fallback's), under
    ``no_grad`` when ``freeze``; returns the last hidden state."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        for gate in "ifco":
            setattr(self, f"U_{gate}", nn.Parameter(torch.empty(input_size, hidden_size)))
            setattr(self, f"V_{gate}", nn.Parameter(torch.empty(hidden_size, hidden_size)))
            setattr(self, f"b_{gate}", nn.Parameter(torch.empty(hidden_size)))
        stdv = 1.0 / self.hidden_size**0.5
        for weight in self.parameters():
            weight.data.uniform_(-stdv, stdv)

    def forward(self, x, freeze=False):
        bs, seq_sz, _ = x.size()
        h_t = torch.zeros(bs, self.hidden_size, dtype=x.dtype)
        c_t = torch.zeros(bs, self.hidden_size, dtype=x.dtype)
        with torch.no_grad() if freeze else contextlib.nullcontext():
            for t in range(seq_sz):
                x_t = x[:, t, :]
                i_t = torch.sigmoid(x_t @ self.U_i + h_t @ self.V_i + self.b_i)
                f_t = torch.sigmoid(x_t @ self.U_f + h_t @ self.V_f + self.b_f)
                g_t = torch.tanh(x_t @ self.U_c + h_t @ self.V_c + self.b_c)
                o_t = torch.sigmoid(x_t @ self.U_o + h_t @ self.V_o + self.b_o)
                c_t = f_t * c_t + i_t * g_t
                h_t = o_t * torch.tanh(c_t)
        return h_t


class CordsLSTMModel(nn.Module):
    """``cords/utils/models/embedding_lstm.py``'s ``LSTMModel``: an Embedding and the ``LSTM``
    above, both inside the ``freeze`` context and the LSTM always called with ``freeze=True``
    (as written: only ``fc`` ever trains), then ``fc``."""

    def __init__(self, vocab_size: int, hidden_units: int, embed_dim: int, num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = CordsLSTM(embed_dim, hidden_units)
        self.fc = nn.Linear(hidden_units, num_classes)

    def forward(self, text, last=False, freeze=False):
        with torch.no_grad() if freeze else contextlib.nullcontext():
            embedded = self.embedding(text)
            h = self.lstm(embedded, freeze=True)
        scores = self.fc(h)
        return (scores, h) if last else scores


class CordsLSTMClassifier(nn.Module):
    """``cords/utils/models/lstmclassifier.py``'s ``LSTMClassifier``: pretrained word vectors
    (``Embedding.from_pretrained(weight, freeze=False)``), a batch-first ``nn.LSTM``, ``fc`` on
    ``final_hidden_state[-1]``; the embedding and the LSTM under ``no_grad`` when ``freeze``."""

    def __init__(self, num_classes: int, wordvec: torch.Tensor, hidden_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding.from_pretrained(wordvec, freeze=False)
        self.lstm = nn.LSTM(wordvec.shape[1], hidden_size, num_layers=1, batch_first=True)
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, input_sentence, last=False, freeze=False):
        if freeze:
            with torch.no_grad():
                x = self.word_embeddings(input_sentence)
                output, (final_hidden_state, final_cell_state) = self.lstm(x)
        else:
            x = self.word_embeddings(input_sentence)
            output, (final_hidden_state, final_cell_state) = self.lstm(x)
        logits = self.fc(final_hidden_state[-1])
        return (logits, final_hidden_state[-1]) if last else logits


@pytest.mark.parametrize("arch", ["lstm_model", "lstm_classifier"])
def test_cords_text_models_selection_under_freeze_and_weighted_training(arch):
    """decile-team/cords on its text models (``embedding_lstm.py``'s ``LSTMModel`` with its
    own ``lstm.py`` recurrence, ``lstmclassifier.py``'s GloVe ``LSTMClassifier``), run by
    ``train_sl.py``: the selection's last-layer gradients (``dataselectionstrategy.py``,
    ``model(x, last=True, freeze=True)``) from ``grad1`` of ``fc`` against the closed form,
    then SGD steps on ``torch.dot(losses, weights / weights.sum())``: ``grad1`` against the
    per-example loop, scaled by each example's weight, for every parameter the loss reaches;
    ``LSTMModel`` computes its embedding and recurrence under ``no_grad`` even in training, so
    those parameters get neither ``.grad`` nor ``grad1``."""
    torch.manual_seed(0)
    if arch == "lstm_model":
        model = CordsLSTMModel(vocab_size=9, hidden_units=3, embed_dim=4, num_classes=2).to(D)
    else:
        wordvec = torch.randn(9, 4, dtype=D)
        model = CordsLSTMClassifier(num_classes=2, wordvec=wordvec, hidden_size=3).to(D)
    g = torch.Generator().manual_seed(0)
    text, y = torch.randint(9, (6, 5), generator=g), torch.randint(2, (6,), generator=g)
    criterion_nored = nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for epoch in range(2):
            model.train()
            model.zero_grad()
            out, l1 = model(text, last=True, freeze=True)
            loss = criterion_nored(out, y).sum()
            closed = cords_closed_form(torch.autograd.grad(loss, out, retain_graph=True)[0], l1, 2)
            loss.backward()
            got = torch.cat((model.fc.bias.grad1, model.fc.weight.grad1.flatten(1)), 1)
            assert_close(got, closed, f"epoch {epoch}: grads_per_elem")
            weights = torch.rand(6, generator=g, dtype=D) + 0.1
            optimizer.zero_grad()
            losses = criterion_nored(model(text), y)
            torch.dot(losses, weights / weights.sum()).backward()
            rows = loop_grad(model, lambda o, t: criterion_nored(o, t).sum(), text, y)
            for n, p in model.named_parameters():
                want = torch.einsum("b,b...->b...", weights / weights.sum(), rows[n])
                if arch == "lstm_model" and not n.startswith("fc."):
                    assert p.grad is None and not hasattr(p, "grad1"), n
                    assert not want.any(), n
                    continue
                assert_close(p.grad1, want, f"epoch {epoch}: {n}")
            optimizer.step()


# -- deeplearning-wisc/gradnorm_ood test_ood.py, resnetv2.py --------------------------------------


class StdConv2d(nn.Conv2d):
    """``resnetv2.py``'s weight-standardized convolution: a ``Conv2d`` subclass whose forward
    standardizes the weight per output channel, then ``F.conv2d``."""

    def forward(self, x):
        w = self.weight
        v, m = torch.var_mean(w, dim=[1, 2, 3], keepdim=True, unbiased=False)
        w = (w - m) / torch.sqrt(v + 1e-10)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PreActBottleneck(nn.Module):
    """``resnetv2.py``'s ``PreActBottleneck`` (``GroupNorm(32, ·)`` shrunk to 2 groups)."""

    def __init__(self, cin: int, cout: int, cmid: int, stride: int = 1) -> None:
        super().__init__()
        self.gn1 = nn.GroupNorm(2, cin)
        self.conv1 = StdConv2d(cin, cmid, kernel_size=1, bias=False)
        self.gn2 = nn.GroupNorm(2, cmid)
        self.conv2 = StdConv2d(cmid, cmid, kernel_size=3, stride=stride, padding=1, bias=False)
        self.gn3 = nn.GroupNorm(2, cmid)
        self.conv3 = StdConv2d(cmid, cout, kernel_size=1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or cin != cout:
            self.downsample = StdConv2d(cin, cout, kernel_size=1, stride=stride, bias=False)

    def forward(self, x):
        out = self.relu(self.gn1(x))
        residual = x
        if hasattr(self, "downsample"):
            residual = self.downsample(out)
        out = self.conv1(out)
        out = self.conv2(self.relu(self.gn2(out)))
        out = self.conv3(self.relu(self.gn3(out)))
        return out + residual


class ResNetV2(nn.Module):
    """``resnetv2.py``'s ``ResNetV2`` (BiT), two stages of one unit, widths shrunk: a
    weight-standardized stem, ``ConstantPad2d`` and ``MaxPool2d``, pre-activation bottlenecks,
    ``GroupNorm``, in-place ReLU, average pooling, and a 1x1 ``Conv2d`` head; the forward
    returns ``x[..., 0, 0]``."""

    def __init__(self, head_size: int) -> None:
        super().__init__()
        self.root = nn.Sequential(OrderedDict([
            ("conv", StdConv2d(3, 4, kernel_size=7, stride=2, padding=3, bias=False)),
            ("pad", nn.ConstantPad2d(1, 0)),
            ("pool", nn.MaxPool2d(kernel_size=3, stride=2, padding=0)),
        ]))  # fmt: skip
        self.body = nn.Sequential(OrderedDict([
            ("block1", nn.Sequential(OrderedDict([("unit01", PreActBottleneck(4, 8, 4))]))),
            ("block2", nn.Sequential(OrderedDict([("unit01", PreActBottleneck(8, 8, 4, 2))]))),
        ]))  # fmt: skip
        self.before_head = nn.Sequential(OrderedDict([
            ("gn", nn.GroupNorm(2, 8)), ("relu", nn.ReLU(inplace=True)),
            ("avg", nn.AdaptiveAvgPool2d(output_size=1)),
        ]))  # fmt: skip
        self.head = nn.Sequential(OrderedDict([("conv", nn.Conv2d(8, head_size, 1, bias=True))]))

    def forward(self, x):
        x = self.head(self.before_head(self.body(self.root(x))))
        assert x.shape[-2:] == (1, 1)
        return x[..., 0, 0]


def gradnorm_loss(outputs: torch.Tensor, temperature: float, num_classes: int) -> torch.Tensor:
    """``test_ood.py``'s ``iterate_data_gradnorm`` loss: the KL divergence to the uniform
    distribution up to a constant, ``mean(sum(-1 · log_softmax(out / T)))``."""
    targets = torch.ones((outputs.shape[0], num_classes), dtype=outputs.dtype)
    outputs = outputs / temperature
    return torch.mean(torch.sum(-targets * F.log_softmax(outputs, dim=-1), dim=-1))


def test_gradnorm_ood_scores_of_a_whole_batch_against_the_scripts_batch_of_one_loop():
    """deeplearning-wisc/gradnorm_ood ``test_ood.py``: the GradNorm score of an input is the L1
    norm of the head's weight gradient of the KL divergence between the softmax and the uniform
    distribution; the script sets ``args.batch = 1`` and runs one ``zero_grad``, forward
    (inputs that require grad), backward per image on ``resnetv2.py``'s BiT model in eval mode.
    Here one hooked backward of the whole batch: every ``grad1`` (the weight-standardized
    convolutions are ``Conv2d`` subclasses with their own forward) against the per-example
    loop, and each score ``grad1.abs().sum()`` of ``head.conv.weight`` against the script's
    loop, score for score."""
    torch.manual_seed(0)
    model = ResNetV2(head_size=5).to(D).eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0), dtype=D)
    temperature, num_classes = 1, 5

    confs = []
    for b in range(4):  # the script's loop, batch 1, no hooks
        inputs = x[b : b + 1].clone().requires_grad_(True)
        model.zero_grad()
        gradnorm_loss(model(inputs), temperature, num_classes).backward()
        confs.append(torch.sum(torch.abs(model.head.conv.weight.grad.data)))
    model.zero_grad()

    with gradhooks.add_hooks(model):
        inputs = x.clone().requires_grad_(True)
        gradnorm_loss(model(inputs), temperature, num_classes).backward()
        scores = model.head.conv.weight.grad1.abs().flatten(1).sum(1)
        want = loop_grad(model, lambda o: gradnorm_loss(o, temperature, num_classes), x)
        assert_grad1(model, want, "BiT")
    assert_close(scores, torch.stack(confs), "GradNorm scores")
    assert inputs.grad is not None and inputs.grad.shape == x.shape


# -- mansheej/data_diet data_diet/scores.py, models.py, scripts/get_mean_score.py ----------------


class SimpleCNN(nn.Module):
    """``data_diet/models.py``'s ``SimpleCNN`` (flax, here torch): per width a 3x3 convolution
    and a strided one, each with ReLU, a spatial mean, a Dense."""

    def __init__(self, num_channels=(2, 3), num_classes: int = 4) -> None:
        super().__init__()
        layers, c = [], 3
        for nc in num_channels:
            layers += [nn.Conv2d(c, nc, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(nc, nc, 3, stride=2, padding=1), nn.ReLU()]  # fmt: skip
            c = nc
        self.features = nn.Sequential(*layers)
        self.dense = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.dense(self.features(x).mean(dim=(2, 3)))


class DietBlock(nn.Module):
    """``data_diet/models.py``'s ``ResNetBlock``: conv, norm, ReLU, conv, norm, a projected
    residual where the shapes differ, ReLU."""

    def __init__(self, cin: int, filters: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, filters, 3, stride, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(filters, momentum=0.1, eps=1e-5)
        self.conv2 = nn.Conv2d(filters, filters, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(filters, momentum=0.1, eps=1e-5)
        self.proj = None
        if stride != 1 or cin != filters:
            self.proj = nn.Sequential(
                nn.Conv2d(cin, filters, 1, stride, bias=False), nn.BatchNorm2d(filters)
            )

    def forward(self, x):
        y = self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        residual = x if self.proj is None else self.proj(x)
        return F.relu(residual + y)


class DietResNet(nn.Module):
    """``data_diet/models.py``'s low-resolution ``ResNet`` (stages of one block, 64 filters
    shrunk to 2), ``BatchNorm(use_running_average=not train)``."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.conv_init = nn.Conv2d(3, 2, 3, padding=1, bias=False)
        self.bn_init = nn.BatchNorm2d(2)
        self.blocks = nn.Sequential(DietBlock(2, 2, 1), DietBlock(2, 4, 2))
        self.dense = nn.Linear(4, num_classes)

    def forward(self, x):
        x = F.relu(self.bn_init(self.conv_init(x)))
        return self.dense(self.blocks(x).mean(dim=(2, 3)))


def data_diet_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``data_diet/metrics.py``'s ``cross_entropy_loss`` on one-hot labels, per example."""
    return -torch.sum(F.log_softmax(logits, dim=-1) * labels, dim=-1)


@pytest.mark.parametrize("arch", ["simple_cnn", "resnet18_lowres"])
def test_data_diet_grand_scores_averaged_over_inits_keep_the_same_examples(arch):
    """mansheej/data_diet ``data_diet/scores.py``'s ``get_grad_norm_fn`` (GraNd): the norm of
    each example's whole-model gradient of the cross-entropy with its one-hot label, by
    ``jacrev`` of the batch's per-example losses through the test-mode apply (running
    statistics), at initialization; ``scripts/get_mean_score.py`` averages the scores of
    several runs (inits) and ``run_keep_max_scores.py`` trains on the highest-scoring examples.
    Here the norms of ``quantities=("norms",)`` (never forming ``grad1``), per init, against
    the per-example loop's, and the kept examples the same."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, 8, 8, generator=g, dtype=D)
    y = F.one_hot(torch.randint(4, (8,), generator=g), 4).to(D)
    factory = SimpleCNN if arch == "simple_cnn" else DietResNet
    got, want = [], []
    for seed in range(2):
        torch.manual_seed(seed)
        model = factory().to(D)
        with torch.no_grad():  # state of a model that has seen data
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5, generator=g)
                    m.running_var.uniform_(0.5, 1.5, generator=g)
        model.eval()
        with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as hooks:
            data_diet_cross_entropy(model(x), y).sum().backward()
            got.append(hooks.norms())
        rows = loop_grad(model, lambda o, t: data_diet_cross_entropy(o, t).sum(), x, y)
        want.append(torch.cat([r.flatten(1) for r in rows.values()], 1).norm(dim=1))
        assert_close(got[-1], want[-1], f"init {seed}")
    mean_got, mean_want = torch.stack(got).mean(0), torch.stack(want).mean(0)
    assert_close(mean_got, mean_want, "mean score")
    keep = 5
    assert set(mean_got.argsort(descending=True)[:keep].tolist()) == set(
        mean_want.argsort(descending=True)[:keep].tolist()
    )


def test_data_diet_unclog_scores_from_per_example_logit_jacobians():
    """mansheej/data_diet ``data_diet/scores.py``'s ``compute_unclog_scores`` with
    ``gradients.py``: the mean logit gradients ``mlgs`` (``jacrev`` of the batch-mean logits,
    ``[classes, params]``, averaged over batches of a class-balanced subset), then each image's
    score ``‖Σ_c (J_i[c] - mlgs[c])‖`` from its own logit Jacobian. Here ``J`` of every
    example at once by :func:`gradhooks.jacobians` (``flatten=True``, the parameters in
    ``named_parameters()`` order as ``flatten_jacobian`` concatenates them), on ``models.py``'s
    ``SimpleCNN``; against Jacobians by a loop of ``autograd.grad`` over examples and classes."""
    torch.manual_seed(0)
    model = SimpleCNN(num_channels=(2, 3), num_classes=4).to(D).eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 8, 8, generator=g, dtype=D)
    x_mlgs = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
    params = list(model.parameters())

    def loop_jacobian(inputs):
        rows = []
        for i in range(inputs.shape[0]):
            logits = model(inputs[i : i + 1])[0]
            rows.append(torch.stack([
                torch.cat([d.flatten() for d in torch.autograd.grad(logits[c], params,
                                                                    retain_graph=True)])
                for c in range(logits.shape[0])
            ]))  # fmt: skip
        return torch.stack(rows)

    mlgs = sum(gradhooks.jacobians(model, xb, flatten=True).mean(0) for xb in x_mlgs.split(2)) / 2
    want_mlgs = sum(loop_jacobian(xb).mean(0) for xb in x_mlgs.split(2)) / 2
    assert_close(mlgs, want_mlgs, "mean logit gradients")
    jac = gradhooks.jacobians(model, x, flatten=True)
    assert jac.shape == (6, 4, sum(p.numel() for p in params))
    assert_close(jac, loop_jacobian(x), "logit Jacobians")
    scores = (jac - mlgs).sum(1).norm(dim=1)
    assert_close(scores, (loop_jacobian(x) - want_mlgs).sum(1).norm(dim=1), "unclog scores")


# -- ftramer/Handcrafted-DP cnns.py, baselines.py, models.py, train_utils.py ----------------------


def standardize(x, bn_stats):
    """``models.py``'s ``standardize``: the features normalized by (noisy) dataset statistics,
    channels of zero variance zeroed in place."""
    if bn_stats is None:
        return x
    bn_mean, bn_var = bn_stats
    view = [1] * len(x.shape)
    view[1] = -1
    x = (x - bn_mean.view(view)) / torch.sqrt(bn_var.view(view) + 1e-5)
    x *= (bn_var.view(view) != 0).to(x.dtype)
    return x


class ClipLayer(nn.Module):
    """``models.py``'s ``ClipLayer``: each example's features scaled in place to norm at most
    ``max_norm``."""

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = max_norm

    def forward(self, data):
        norms = torch.norm(data.reshape(data.shape[0], -1), dim=-1)
        scale = (self.max_norm / norms).clamp(max=1.0)
        data *= scale.reshape(-1, 1, 1, 1)
        return data


class ScatterCNN(nn.Module):
    """``models.py``'s ``MNIST_CNN`` on ScatterNet features (``in_channels != 1``: ``K`` channels
    of 7x7, shrunk to 3): an input norm (``GroupNorm(affine=False)``, or ``standardize`` by
    ``bn_stats`` through a lambda), a strided and a plain 3x3 convolution with Tanh, and a
    Tanh MLP classifier."""

    def __init__(self, k: int, input_norm: str, bn_stats=None) -> None:
        super().__init__()
        self.in_channels = k
        if input_norm == "GroupNorm":
            self.norm = nn.GroupNorm(3, k, affine=False)
        else:
            self.norm = lambda x: standardize(x, bn_stats)
        self.features = nn.Sequential(
            nn.Conv2d(k, 4, kernel_size=3, stride=2, padding=1), nn.Tanh(),
            nn.Conv2d(4, 4, kernel_size=3, stride=1, padding=1), nn.Tanh(),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(4 * 4 * 4, 5), nn.Tanh(), nn.Linear(5, 10))

    def forward(self, x):
        x = self.norm(x.view(-1, self.in_channels, 7, 7))
        x = self.features(x)
        x = x.view(x.size(0), -1)
        return self.classifier(x)


class ScatterLinear(nn.Module):
    """``models.py``'s ``ScatterLinear`` (``baselines.py``): the input norm, ``ClipLayer``, a
    Linear on the flattened features."""

    def __init__(self, k: int, clip_norm: float) -> None:
        super().__init__()
        self.K, self.h, self.w = k, 7, 7
        self.fc = nn.Linear(k * 7 * 7, 10)
        self.norm = nn.GroupNorm(3, k, affine=False)
        self.clip = ClipLayer(clip_norm)

    def forward(self, x):
        x = self.norm(x.view(-1, self.K, self.h, self.w))
        x = self.clip(x)
        x = x.reshape(x.size(0), -1)
        return self.fc(x)


@pytest.mark.parametrize("arch", ["cnn_group_norm", "cnn_bn_stats", "scatter_linear_clip"])
def test_handcrafted_dp_virtual_steps_over_fixed_mini_batches(arch):
    """ftramer/Handcrafted-DP ``cnns.py`` / ``baselines.py`` with ``train_utils.py``'s ``train``:
    the ScatterNet features (precomputed, ``K`` channels of 7x7) into ``models.py``'s CNN or
    ``ScatterLinear``, Opacus' engine attached to SGD with momentum, logical batches of
    ``batch_size`` made of ``n_acc_steps`` shuffled mini-batches: ``virtual_step()`` after each
    but the last, which steps. Here each mini-batch's clipped sum
    (:func:`gradhooks.clipped_sum`, book-keeping norms), added up over the logical batch, the
    noise drawn once, divided by ``batch_size``; a ``no_grad`` test pass in eval mode between
    epochs. Each step's update against an unhooked twin fed the loop's clipped per-example
    gradients and the same noise."""
    torch.manual_seed(0)
    k, max_grad_norm, sigma, bs, mini = 3, 0.1, 1.0, 8, 4
    g = torch.Generator().manual_seed(0)
    if arch == "scatter_linear_clip":
        model = ScatterLinear(k, clip_norm=2.0).to(D)
    elif arch == "cnn_group_norm":
        model = ScatterCNN(k, "GroupNorm").to(D)
    else:
        stats = (torch.randn(k, generator=g, dtype=D), torch.tensor([1.5, 0.0, 0.7], dtype=D))
        model = ScatterCNN(k, "BN", bn_stats=stats).to(D)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.5, momentum=0.9)
    data = torch.randn(16, k, 7, 7, generator=g, dtype=D) * 2
    target = torch.randint(10, (16,), generator=g)
    noise_gen = torch.Generator().manual_seed(1)
    n_acc_steps = bs // mini
    names = [n for n, _ in model.named_parameters()]

    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        for epoch in range(2):
            model.train()
            sums, twin_sums = None, None
            order = torch.randperm(16, generator=g)
            for batch_idx, idxs in enumerate(order.split(mini)):
                x, y = data[idxs], target[idxs]
                output = model(x.clone())
                got = gradhooks.clipped_sum(
                    hooks, F.cross_entropy(output, y, reduction="none"), max_norm=max_grad_norm
                )
                sums = got.sums if sums is None else [s + t for s, t in zip(sums, got.sums)]
                rows = loop_grad(twin, lambda o, t: F.cross_entropy(o, t), x.clone(), y)
                norms = torch.cat([rows[n].flatten(1) for n in names], 1).norm(dim=1)
                assert_close(got.norms, norms, f"epoch {epoch} batch {batch_idx}: norms")
                factors = (max_grad_norm / norms).clamp(max=1.0)
                clipped = [torch.einsum("b,b...->...", factors, rows[n]) for n in names]
                twin_sums = clipped if twin_sums is None else [
                    s + t for s, t in zip(twin_sums, clipped)
                ]  # fmt: skip
                if (batch_idx + 1) % n_acc_steps == 0:
                    for p, q, s, t in zip(model.parameters(), twin.parameters(), sums, twin_sums):
                        noise = torch.normal(0, sigma * max_grad_norm, p.shape,
                                             generator=noise_gen, dtype=D)  # fmt: skip
                        p.grad = (s + noise) / bs
                        q.grad = (t + noise) / bs
                    optimizer.step()
                    twin_optimizer.step()
                    optimizer.zero_grad()
                    twin_optimizer.zero_grad()
                    sums, twin_sums = None, None
                    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                        assert_close(p.detach(), q.detach(), f"epoch {epoch} step: {n}")
            model.eval()
            with torch.no_grad():
                model(torch.randn(5, k, 7, 7, generator=g, dtype=D)).argmax(1)


# -- kiddyboots216/dp-custom dp_finetuning/finetune_classifier_dp.py --------------------------------


class WithIndices(torch.utils.data.Dataset):
    """``dp_finetuning/utils.py``'s ``dataset_with_indices``: each item ``(x, y, index)``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_dp_raft_full_batch_linear_probe_with_an_ema_copy_of_the_private_model():
    """kiddyboots216/dp-custom ``dp_finetuning/finetune_classifier_dp.py`` (DP-RAFT): a
    bias-free ``nn.Linear`` on extracted features, its weight zeroed (``--standardize_weights``),
    made private with full batches (``sample_rate`` 1: one logical batch per epoch), SGD with
    momentum and weight decay, ``CosineAnnealingLR`` stepped before each epoch, an EMA
    (``torch.optim.swa_utils.AveragedModel`` of the *hooked* model, its own ``avg_fn``) updated
    after each epoch and tested beside the model under ``no_grad``; the loader's items carry
    their indices, by which the ``individual`` mode books each example's gradient norm. Here
    ``gradhooks.make_private`` without noise: the norms against the loop's, the weights and
    the EMA's against an unhooked twin fed the loop's clipped mean."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    features, labels = (
        torch.randn(10, 6, generator=g, dtype=D),
        torch.randint(3, (10,), generator=g),
    )
    model = nn.Linear(6, 3, bias=False).to(D)
    model.weight.data.zero_()
    twin = copy.deepcopy(model)
    opts = dict(lr=0.5, weight_decay=1e-3, momentum=0.9, nesterov=False)
    optimizer = torch.optim.SGD(model.parameters(), **opts)
    twin_optimizer = torch.optim.SGD(twin.parameters(), **opts)
    epochs, max_norm = 3, 0.5
    private = gradhooks.make_private(
        model, optimizer, WithIndices(features, labels), delta=1e-5, noise_multiplier=0.0,
        steps=epochs, sample_rate=1.0, max_grad_norm=max_norm,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(private.optimizer, epochs)
    twin_sched = torch.optim.lr_scheduler.CosineAnnealingLR(twin_optimizer, epochs)

    def ema_avg(averaged, current, num_averaged):
        return 0.1 * averaged + 0.9 * current

    ema_model = torch.optim.swa_utils.AveragedModel(model, avg_fn=ema_avg)
    twin_ema = torch.optim.swa_utils.AveragedModel(twin, avg_fn=ema_avg)
    usage = torch.zeros(10, dtype=D)
    criterion = nn.CrossEntropyLoss(reduction="none")
    try:
        batches = private.batches()
        for epoch in range(1, epochs + 1):
            sched.step()  # (before the epoch's step, as the script does)
            twin_sched.step()
            model.train()
            data, target, indices = next(batches)
            assert sorted(indices.tolist()) == list(range(10))
            norms = private.backward(criterion(model(data), target))
            rows = loop_grad(twin, lambda o, t: criterion(o, t).sum(), data, target)["weight"]
            assert_close(norms, rows.flatten(1).norm(dim=1), f"epoch {epoch}: norms")
            usage[indices] += norms.clamp(max=max_norm) ** 2 / max_norm**2
            factors = (max_norm / rows.flatten(1).norm(dim=1)).clamp(max=1.0)
            twin.weight.grad = torch.einsum("b,b...->...", factors, rows) / 10
            assert private.step()
            twin_optimizer.step()
            twin_optimizer.zero_grad()
            assert_close(model.weight.detach(), twin.weight.detach(), f"epoch {epoch}: weight")
            with torch.no_grad():
                for m in (model, ema_model):
                    m.eval()
                    m(features).argmax(dim=1)
            ema_model.update_parameters(model)
            twin_ema.update_parameters(twin)
            assert_close(
                ema_model.module.weight.detach(),
                twin_ema.module.weight.detach(),
                f"epoch {epoch}: EMA",
            )
    finally:
        private.close()
    assert (usage > 0).all() and (usage <= epochs).all()
    assert not hasattr(ema_model.module.weight, "grad1")


# -- woodyx218/private_vision examples/cifar.py, on timm's Beit -----------------------------------


class BeitAttention(nn.Module):
    """timm ``timm/models/beit.py``'s ``Attention``: ``qkv`` a bias-free Linear whose weight
    the forward uses with ``F.linear`` and the bias ``cat(q_bias, k_bias, v_bias)`` (``k_bias``
    a zero buffer), a relative position bias gathered from a table by a fixed index."""

    def __init__(self, dim: int, num_heads: int, window: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.randn(dim) * 0.1)
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(dim) * 0.1)
        tokens = window * window + 1
        self.relative_position_bias_table = nn.Parameter(torch.randn(7, num_heads) * 0.1)
        index = torch.randint(7, (tokens, tokens), generator=torch.Generator().manual_seed(0))
        self.register_buffer("relative_position_index", index, persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        table = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        attn = attn + table.view(N, N, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class BeitBlock(nn.Module):
    """timm's Beit ``Block``: pre-norm attention and MLP, each scaled by a layer-scale
    parameter (``gamma_1``, ``gamma_2``) used in the block's own forward."""

    def __init__(self, dim: int, num_heads: int, window: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = BeitAttention(dim, num_heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.gamma_1 = nn.Parameter(0.1 * torch.ones(dim))
        self.gamma_2 = nn.Parameter(0.1 * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class Beit(nn.Module):
    """timm's ``Beit`` (2 blocks of width 4, 8x8 images in 4x4 patches): a strided-conv patch
    embedding, a ``cls_token`` concatenated in the model's own forward, average pooling of the
    patch tokens, ``fc_norm``, the head."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, 4, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4) * 0.02)
        self.blocks = nn.ModuleList([BeitBlock(4, 2, window=2) for _ in range(2)])
        self.fc_norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.fc_norm(x[:, 1:].mean(1)))


def test_private_vision_cifar_beit_with_its_frozen_parameters_and_ghost_virtual_steps():
    """woodyx218/private_vision ``examples/cifar.py`` with ``--model beit...`` and ``--mode
    ghost_mixed``: timm's Beit with the script's freezes (``gamma_``,
    ``relative_position_bias_table``, ``attn.qkv.weight``, ``attn.q_bias``, ``attn.v_bias``,
    ``cls_token``: every parameter the model uses outside a layer's own call, and the qkv
    Linear whose weight its parent uses), ``CrossEntropyLoss(reduction="none")``, Adam, logical
    batches of ``bs`` over ``mini_batch_size`` physical ones (``optimizer.virtual_step(loss)``,
    then ``optimizer.step(loss)``), the noise once per logical batch, a ``no_grad`` test pass.
    Here each mini-batch's ghost-clipped sum (:func:`gradhooks.clipped_sum`, ``method="ghost"``)
    added up; each step against an unhooked twin fed the loop's clipped gradients and the same
    noise; the frozen parameters get no ``grad1`` and no ``.grad``."""
    torch.manual_seed(0)
    net = Beit().to(D)
    frozen = ("gamma_", "relative_position_bias_table", "attn.qkv.weight", "attn.q_bias",
              "attn.v_bias", "cls_token", "pos_embed")  # fmt: skip
    for name, param in net.named_parameters():
        if any(f in name for f in frozen):
            param.requires_grad = False
    twin = copy.deepcopy(net)
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    twin_optimizer = torch.optim.Adam([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    criterion = nn.CrossEntropyLoss(reduction="none")
    bs, mini, grad_norm, sigma = 6, 3, 0.1, 0.5
    g = torch.Generator().manual_seed(0)
    inputs_all = torch.randn(12, 3, 8, 8, generator=g, dtype=D)
    targets_all = torch.randint(3, (12,), generator=g)
    noise_gen = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(net, quantities=("norms",)) as hooks:
        net.train()
        sums = twin_sums = None
        for batch_idx, idxs in enumerate(torch.randperm(12, generator=g).split(mini)):
            inputs, targets = inputs_all[idxs], targets_all[idxs]
            loss = criterion(net(inputs), targets)
            got = gradhooks.clipped_sum(hooks, loss, max_norm=grad_norm, method="ghost")
            rows = loop_grad(twin, lambda o, t: criterion(o, t).sum(), inputs, targets)
            norms = torch.cat([rows[n].flatten(1) for n in names], 1).norm(dim=1)
            assert_close(got.norms, norms, f"batch {batch_idx}: norms")
            factors = (grad_norm / norms).clamp(max=1.0)
            clipped = [torch.einsum("b,b...->...", factors, rows[n]) for n in names]
            sums = got.sums if sums is None else [s + t for s, t in zip(sums, got.sums)]
            twin_sums = clipped if twin_sums is None else [
                s + t for s, t in zip(twin_sums, clipped)
            ]  # fmt: skip
            if (batch_idx + 1) % (bs // mini) == 0:
                params = [p for p in net.parameters() if p.requires_grad]
                twin_params = [p for p in twin.parameters() if p.requires_grad]
                for p, q, s, t in zip(params, twin_params, sums, twin_sums):
                    noise = torch.normal(0, sigma * grad_norm, p.shape, generator=noise_gen,
                                         dtype=D)  # fmt: skip
                    p.grad, q.grad = (s + noise) / bs, (t + noise) / bs
                optimizer.step()
                twin_optimizer.step()
                optimizer.zero_grad()
                twin_optimizer.zero_grad()
                sums = twin_sums = None
                for (n, p), q in zip(net.named_parameters(), twin.parameters()):
                    assert_close(p.detach(), q.detach(), f"step {batch_idx // 2}: {n}")
        for n, p in net.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and not hasattr(p, "grad1"), n
        net.eval()
        with torch.no_grad():
            criterion(net(inputs_all[:4]), targets_all[:4]).mean()


# -- Jiachen-T-Wang/GhostSuite Examples/ghost_mlp.py, Examples/ghost_gradproj_mlp.py --------------


class GhostMLP(nn.Module):
    """GhostSuite ``Examples/ghost_mlp.py``'s ``TwoLayerMLP`` (``ghost_gradproj_mlp.py``'s
    ``SimpleMLP`` is the same): ``fc1``, ReLU, ``fc2``."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_ghostsuite_grad_dot_products_of_a_concatenated_train_and_validation_batch():
    """Jiachen-T-Wang/GhostSuite ``Examples/ghost_mlp.py`` (``GradDotProdEngine``, online data
    selection): each step runs the training batch and the validation batch concatenated, one
    ``cross_entropy(..., reduction="mean")`` over both, reads per parameter the dot products of
    each training example's gradient with the validation gradient, then puts the training
    examples' gradient alone into ``.grad`` (``prepare_gradients``) for SGD. Here ``grad1`` of
    the concatenated batch, its rows split: the dot products against the loop's, ``.grad``
    from the training rows, each step against an unhooked twin stepped on the loop's mean of
    the training examples' gradients."""
    torch.manual_seed(100)
    g = torch.Generator().manual_seed(100)
    n_train, n_val, in_dim, out_dim = 8, 4, 10, 4
    w = torch.randn(in_dim, out_dim, generator=g, dtype=D)
    x_tr, x_val = (
        torch.randn(n_train, in_dim, generator=g, dtype=D),
        torch.randn(n_val, in_dim, generator=g, dtype=D),
    )
    y_tr, y_val = (x_tr @ w).argmax(dim=-1), (x_val @ w).argmax(dim=-1)
    model = GhostMLP(in_dim, 8, out_dim).to(D)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1e-1)
    x_cat, y_cat = torch.cat([x_tr, x_val], dim=0), torch.cat([y_tr, y_val], dim=0)
    with gradhooks.add_hooks(model):
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            logits = model(x_cat)
            F.cross_entropy(logits, y_cat, reduction="mean").backward()
            rows = loop_grad(twin, lambda o, t: F.cross_entropy(o, t), x_cat, y_cat)
            for name, p in model.named_parameters():
                got = torch.einsum("b...,...->b", p.grad1[:n_train], p.grad1[n_train:].mean(0))
                want = torch.einsum(
                    "b...,...->b", rows[name][:n_train], rows[name][n_train:].mean(0)
                )
                assert_close(got, want, f"step {step}: {name} val·train")
                p.grad = p.grad1[:n_train].mean(0)
            for name, q in twin.named_parameters():
                q.grad = rows[name][:n_train].mean(0)
            optimizer.step()
            twin_optimizer.step()
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert_close(p.detach(), q.detach(), f"step {step}: {name}")


def test_ghostsuite_kronecker_projected_per_example_gradients_against_its_naive_check():
    """Jiachen-T-Wang/GhostSuite ``Examples/ghost_gradproj_mlp.py`` (``GradProjLoraEngine``, as
    LoGra): each Linear weight's per-example gradient projected to ``P_o @ grad @ P_i.T`` (the
    two Gaussian projections of its input and output sides), concatenated over the layers in
    name order, collected after each ``loss.backward()`` of a ``CrossEntropyLoss`` mean while
    SGD trains; its ``naive_check`` mode computes them one example at a time. Here from
    ``grad1`` of each weight, at every step, against that naive loop; the hooks leave the
    training trajectory as it is without them (the script's ``non_interf`` mode)."""
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(42)
    model = GhostMLP(10, 20, 5).to(D)
    twin = copy.deepcopy(model)
    layers = {"fc1": model.fc1, "fc2": model.fc2}
    projections = {
        name: (torch.randn(3, layer.in_features, generator=g, dtype=D),
               torch.randn(2, layer.out_features, generator=g, dtype=D))
        for name, layer in sorted(layers.items())
    }  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
    with gradhooks.add_hooks(model):
        for step in range(3):
            inputs = torch.randn(8, 10, generator=g, dtype=D)
            targets = torch.randint(0, 5, (8,), generator=g)
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            loss.backward()
            got = torch.cat([
                torch.einsum("ko,bon,in->bki", p_o, layers[name].weight.grad1, p_i).flatten(1)
                for name, (p_i, p_o) in projections.items()
            ], dim=1)  # fmt: skip
            naive = []
            with gradhooks.paused():
                for b in range(8):
                    twin.zero_grad()
                    criterion(twin(inputs[b : b + 1]), targets[b : b + 1]).mean().backward()
                    naive.append(torch.cat([
                        (p_o @ twin.get_submodule(name).weight.grad @ p_i.t()).reshape(-1)
                        for name, (p_i, p_o) in projections.items()
                    ]))  # fmt: skip
            assert_close(got, torch.stack(naive), f"step {step}: projections")
            twin.zero_grad()
            criterion(twin(inputs), targets).backward()
            optimizer.step()
            twin_optimizer.step()
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert_close(p.detach(), q.detach(), f"step {step}: {name}")

"""Training-loop idioms, a tenth set: what loops do around the step, and how they misuse it.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), an idiom the earlier sets do not run: a classifier that flattens its pooled features with
``.squeeze()``, given a last batch of one; the gradient's norm logged by ``torch.autograd.grad``
before the loss's ``backward()``; ``clip_grad_norm_(foreach=True)`` and its two halves,
``get_total_norm`` and ``clip_grads_with_norm_``; SWA's ``update_bn`` on the averaged copy and
on the hooked model, whose BatchNorm trains frozen; parameters written back from one flat vector
(``vector_to_parameters``); features computed under ``inference_mode`` for a linear probe; an
empty micro-batch in an accumulation; deep mutual learning (two hooked students, one loss);
SimSiam's stop-gradient; a deep copy and a whole-model save between the forward and the
backward; ``model.apply(init)`` and ``reset_parameters`` between steps; a weight-norm
parametrization removed mid-training; a forward that runs out of memory half way, then the batch
in halves; a ``Sequential`` sliced into features and head; a loss scaled by
``backward(gradient=...)``; one submodule's ``zero_grad``; a forward for logging, with grad
enabled, between a forward and its backward; examples reweighted by their gradients' norms in a
second forward; a pipeline's schedule (every micro-batch forward, then the backwards in
reverse); a batch chunked through the model in one backward, and forwards on the same rows of
one tensor; hooks added between two micro-batches. Each is compared with each example's own gradient by a per-example loop in
float64 (:func:`gradhooks.oracle.loop_grad`), or checked to stop with an error that says what
went wrong and leaves the model as it was.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from test_idioms_seventh import assert_unchanged, batch, snapshot, summed_ce
from torch import nn
from torch.nn.utils import parameters_to_vector, parametrize, vector_to_parameters
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad
from harness import NormNet, assert_close, assert_grad1, mlp

D = torch.float64


def added(a: dict, b: dict) -> dict:
    return {n: a[n] + b[n] for n in b}


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in want.values()))


# -- a batch of one whose batch dimension ``.squeeze()`` takes away ----------------------------


class _PooledClassifier(nn.Module):
    """A small CNN whose pooled features are flattened by ``.squeeze()`` (as many older scripts
    do, rather than ``flatten(1)``): ``[batch, C, 1, 1]`` becomes ``[batch, C]``, and, on a batch
    of one, ``[C]``: the head (a Linear, or a LayerNorm then a Linear) gets its one example's
    features without a batch dimension."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(3, 2)
        if head == "norm":
            self.fc = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2))

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(torch.tanh(self.conv(x)), 1).squeeze())


def _rows_ce(out, y):
    """Cross-entropy over the head's rows, whichever shape ``.squeeze()`` left them in."""
    return F.cross_entropy(out.reshape(len(y), -1), y)


@pytest.mark.parametrize("head", ["linear", "norm"], ids=["Linear", "LayerNorm, Linear"])
def test_a_batch_of_one_squeezed_into_the_classifier_heads_features(head):
    """Seven images in batches of three (``DataLoader``, ``drop_last=False``): the last batch is
    one image, whose pooled features ``.squeeze()`` makes ``[3]``, and whose logits are ``[2]``.
    Before, the tracker lost the example at the head (a Linear contracting, or a LayerNorm
    normalizing, the dimension that held it): the Linear's rule failed with a RuleError about
    an ``unflatten``, or was given the ``[3]`` as it was (an UnbatchedInputError). With one
    example, their output is that example's whole. grad1 is the float64 loop's at every step
    of two epochs, the batch of one included, and so is the DP step's norm on it."""
    torch.manual_seed(0)
    model = _PooledClassifier(head).to(D)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(7, 2, 5, 5, dtype=D, generator=g), torch.randint(2, (7,), generator=g)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            for x, y in DataLoader(data, batch_size=3):
                want = loop_grad(model, _rows_ce, x, y)
                opt.zero_grad()
                _rows_ce(model(x), y).backward()
                assert_grad1(model, want, f"epoch {epoch}, a batch of {len(y)}")
                opt.step()
    x, y = data[6:7]
    want = norms_of(loop_grad(model, _rows_ce, x, y))
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        losses = F.cross_entropy(model(x).reshape(1, -1), y, reduction="none")
        got = gradhooks.dp_sgd_step(hooks, losses, max_norm=0.1, noise_multiplier=0.0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# -- the gradient's norm logged by torch.autograd.grad before the backward ---------------------


class _TiedLM(nn.Module):
    """A language model whose output projection is its embedding's weight, used through
    ``F.linear`` in its own forward (nanoGPT's ``lm_head`` tied to ``wte``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(11, 4), nn.Linear(4, 4)

    def forward(self, idx):
        return F.linear(torch.tanh(self.fc(self.emb(idx))), self.emb.weight)


def _token_ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _problem(kind: str, seed: int):
    """A model's batch and loss: the MLP's, or the tied language model's (token ids)."""
    if kind == "mlp":
        return batch(seed), F.cross_entropy
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(11, (4, 5), generator=g), torch.randint(11, (4, 5), generator=g)
    return tokens, _token_ce


@pytest.mark.parametrize("kind", ["mlp", "tied embedding"])
def test_the_gradients_norm_logged_by_autograd_grad_before_the_losss_backward(kind):
    """A loop that logs the gradient's norm before stepping takes it with
    ``torch.autograd.grad(loss, params, retain_graph=True)``, then calls ``loss.backward()``
    (two micro-batches per step, Adam). ``torch.autograd.grad`` leaves ``.grad`` alone and
    writes grad1 (docs/training.md); before, the backward after it added to that grad1: each
    example's gradient was in grad1 twice, and in the second micro-batch the first's rows were
    dropped, while ``.grad`` held each once. The backward now puts back the grad1 that was
    ``.grad``'s rows before the ``torch.autograd.grad``: grad1 is the float64 loop's sum over
    the step's micro-batches (of a layer's parameters, and of an embedding also used by the
    model's own ``F.linear``), ``hooks.check()`` finds it reduces to ``.grad``, and
    ``hooks.accumulated`` counts the backwards into ``.grad``."""
    model = mlp() if kind == "mlp" else _TiedLM().double()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(2):
            opt.zero_grad()
            want = None
            for micro in range(2):
                (x, y), loss_fn = _problem(kind, 10 * step + micro)
                got = loop_grad(model, loss_fn, x, y)
                want = got if want is None else added(want, got)
                loss = loss_fn(model(x), y)
                grads = torch.autograd.grad(loss, params, retain_graph=True)
                norm = torch.sqrt(sum(g.square().sum() for g in grads))
                assert math.isfinite(norm.item())
                loss.backward()
                assert_grad1(model, want, f"step {step}, micro-batch {micro}")
                assert hooks.accumulated == micro + 1
            hooks.check()
            opt.step()


# -- clipping: foreach, and the total norm taken apart ------------------------------------------


@pytest.mark.parametrize("how", ["clip_grad_norm_", "get_total_norm"])
def test_clip_grad_norm_with_foreach_and_the_total_norm_taken_apart(how):
    """timm's ``dispatch_clip_grad(mode="norm")`` is ``clip_grad_norm_``; torch also splits it
    into ``get_total_norm`` and ``clip_grads_with_norm_`` (FSDP2 loops reduce the norm across
    ranks between the two). Either, with ``foreach=True`` (and ``error_if_nonfinite=True``),
    scales ``.grad`` in place after the backward: grad1 stays each example's own gradient,
    unclipped (the float64 loop's), ``.grad`` is the clipped mean of grad1's rows, and the next
    ``zero_grad`` starts afresh."""
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            total = torch.sqrt(sum(w.mean(0).square().sum() for w in want.values()))
            if how == "clip_grad_norm_":
                nn.utils.clip_grad_norm_(params, 0.05, foreach=True, error_if_nonfinite=True)
            else:
                norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
                nn.utils.clip_grads_with_norm_(params, 0.05, norm, foreach=True)
            assert_grad1(model, want, f"step {step}")
            factor = (0.05 / (total + 1e-6)).clamp(max=1.0)
            assert factor < 1, "the clip must act for the test to tell"
            for n, p in model.named_parameters():
                assert_close(p.grad, factor * p.grad1.mean(0), f"step {step}: {n}'s .grad")
            opt.step()


# -- SWA: update_bn on the averaged copy and on the hooked model ---------------------------------


def test_swa_update_bn_on_the_averaged_copy_and_on_the_hooked_model():
    """``torch.optim.swa_utils``: an ``AveragedModel`` of the hooked model (a deep copy, not
    hooked) updated after each step, and ``update_bn`` run over a loader on the averaged copy
    and on the hooked model itself: both put the model in training mode and run forwards under
    ``no_grad``, where a BatchNorm in training mode computes nothing gradhooks refuses. The
    training steps (BatchNorm frozen in eval mode) give the float64 loop's grad1 after each
    ``update_bn``; the averaged copy has no grad1."""
    model = NormNet().double()
    swa = torch.optim.swa_utils.AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [batch(100 + i, n=6)[0] for i in range(3)]
    with gradhooks.add_hooks(model):
        for step in range(3):
            model.train()
            model.bn.eval()
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            swa.update_parameters(model)
            torch.optim.swa_utils.update_bn(loader, swa)
            torch.optim.swa_utils.update_bn(loader, model)
    assert not any(hasattr(p, "grad1") for p in swa.parameters())
    for bn in (swa.module.bn, model.bn):  # (the statistics reset, then the loader's 3 batches)
        assert bn.num_batches_tracked.item() == 3


# -- parameters written back from one flat vector ----------------------------------------------


def test_parameters_written_back_from_a_flat_vector_between_steps():
    """TRPO's and evolution strategies' update: ``parameters_to_vector`` of the parameters and
    of ``.grad``, a step on the flat vector, then ``vector_to_parameters``, which sets each
    parameter's ``.data`` to a view of the new vector. grad1 is the float64 loop's at each
    step, with the parameters views of one vector."""
    model = mlp()
    params = list(model.parameters())
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            flat = parameters_to_vector([p.grad for p in params])
            with torch.no_grad():
                vector_to_parameters(parameters_to_vector(params) - 0.5 * flat, params)
    assert params[0].untyped_storage().data_ptr() == params[-1].untyped_storage().data_ptr()


# -- a linear probe on features computed under inference_mode ----------------------------------


def test_a_linear_probe_on_features_computed_under_inference_mode():
    """A frozen backbone run under ``torch.inference_mode()``, its features cloned into normal
    tensors (torch's advice) and given to the hooked head: grad1 of the head is the float64
    loop's at each step. Given as they are, inference tensors fail in torch's own forward
    (they cannot be saved for backward), as without gradhooks: no grad1 is written, and the
    head is as it was."""
    torch.manual_seed(1)
    backbone = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).to(D)
    head = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    with gradhooks.add_hooks(head):
        for step in range(2):
            x, y = batch(step)
            with torch.inference_mode():
                features = backbone(x)
            features = features.clone()
            want = loop_grad(head, F.cross_entropy, features, y)
            opt.zero_grad()
            F.cross_entropy(head(features), y).backward()
            assert_grad1(head, want, f"step {step}")
            opt.step()
        opt.zero_grad()
        with torch.inference_mode():
            features = backbone(batch(5)[0])
        before, kept = snapshot(head), {n: p.grad1 for n, p in head.named_parameters()}
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            head(features)
        assert_unchanged(head, before, "the failed forward")
        assert all(p.grad1 is kept[n] for n, p in head.named_parameters())
        F.cross_entropy(head(features.clone()), batch(5)[1]).backward()  # (and the next step)
        assert_grad1(head, loop_grad(head, F.cross_entropy, features.clone(), batch(5)[1]), "after")


# -- an empty micro-batch in an accumulation ---------------------------------------------------


@pytest.mark.parametrize("where", ["last", "first", "between"])
def test_an_empty_micro_batch_in_an_accumulation_adds_nothing(where):
    """Gradient accumulation over a filtered loader where one micro-batch came out empty
    (every example dropped): its summed loss is 0, with a gradient of zeros that adds nothing
    to ``.grad``. Before, grad1 refused it (a StateError: 4 rows cannot take 0); now it adds
    nothing to any example's row either: grad1 is the float64 loop's sum over the micro-batches
    that had examples, ``hooks.check()`` finds it reduces to ``.grad``, and the step goes on,
    at each of two steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = batch(99, n=0)
    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        for step in range(2):
            full = [batch(10 * step), batch(10 * step + 1)]
            micro = {"last": [*full, empty], "first": [empty, *full],
                     "between": [full[0], empty, full[1]]}[where]  # fmt: skip
            want = None
            for x, y in full:
                got = loop_grad(model, summed_ce, x, y)
                want = got if want is None else added(want, got)
            opt.zero_grad()
            for x, y in micro:
                summed_ce(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, the empty micro-batch {where}")
            hooks.check()
            opt.step()


# -- deep mutual learning: two hooked students, one loss ---------------------------------------


def _student(seed: int, width: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)).to(D)


class _Cohort(nn.Module):
    """Both students, for the per-example loop: their logits stacked."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return torch.stack([self.a(x), self.b(x)])


def _mutual(out, y):
    """Deep mutual learning's loss: each student's cross-entropy and the KL divergence between
    the two (``batchmean``: a mean over the examples)."""
    a, b = out
    kl = F.kl_div(F.log_softmax(a, 1), F.log_softmax(b, 1), reduction="batchmean", log_target=True)
    return F.cross_entropy(a, y) + F.cross_entropy(b, y) + kl


def test_deep_mutual_learning_two_hooked_students_trained_by_one_loss():
    """Deep mutual learning trains two students on one loss (each one's cross-entropy and the
    KL divergence between their predictions), each hooked by its own handle and stepped by its
    own optimizer. Each student's grad1 is the float64 loop's of the joint loss at each step."""
    a, b = _student(0, 5), _student(1, 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    cohort = _Cohort(a, b)
    with gradhooks.add_hooks(a), gradhooks.add_hooks(b):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(cohort, _mutual, x, y)
            for opt in opts:
                opt.zero_grad()
            _mutual((a(x), b(x)), y).backward()
            for name, m in (("a", a), ("b", b)):
                own = {n[2:]: g for n, g in want.items() if n.startswith(f"{name}.")}
                assert_grad1(m, own, f"step {step}, student {name}")
            for opt in opts:
                opt.step()


# -- SimSiam: a stop-gradient on the other view's projection ------------------------------------


class _SimSiam(nn.Module):
    """SimSiam (facebookresearch/simsiam's ``builder.py``): an encoder and a predictor; the
    forward returns both views' predictions and their projections, detached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
        self.predictor = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 4))

    def forward(self, x1, x2):
        z1, z2 = self.encoder(x1), self.encoder(x2)
        return self.predictor(z1), self.predictor(z2), z1.detach(), z2.detach()


def _simsiam_loss(out):
    p1, p2, z1, z2 = out
    return -(F.cosine_similarity(p1, z2).mean() + F.cosine_similarity(p2, z1).mean()) * 0.5


def test_simsiam_with_a_stop_gradient_on_the_other_views_projection():
    """SimSiam's ``main_simsiam.py`` loop: two augmented views of each image through the same
    encoder and predictor, a negative cosine similarity of each view's prediction with the
    other's detached projection, SGD with momentum. Example ``i`` is image ``i`` with both its
    views: grad1 is the float64 loop's at each step."""
    model = _SimSiam().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x1, _ = batch(step)
            x2 = x1 + 0.1 * batch(step + 50)[0]
            want = loop_grad(model, _simsiam_loss, (x1, x2))
            opt.zero_grad()
            _simsiam_loss(model(x1, x2)).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- a deep copy and a whole-model save between the forward and the backward --------------------


def test_a_deep_copy_and_a_whole_model_save_between_the_forward_and_its_backward():
    """A loop that snapshots the best model (``copy.deepcopy``) and saves the whole model
    (``torch.save(model)``) after the forward, before the backward. The backward then gives
    the float64 loop's grad1; the copy and the loaded model are not hooked, carry no grad1,
    and train without writing one."""
    model = mlp()
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        best = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        loss.backward()
        assert_grad1(model, want, "the original")
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        for other in (best, loaded):
            assert not any(hasattr(p, "grad1") for p in other.parameters())
            F.cross_entropy(other(x), y).backward()
            assert not any(hasattr(p, "grad1") for p in other.parameters())
            assert all(p.grad is not None for p in other.parameters())
        assert_grad1(model, want, "the original, after the copies' steps")


# -- re-initialization between steps ------------------------------------------------------------


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        nn.init.zeros_(module.bias)


def test_parameters_reinitialized_in_place_between_steps():
    """``model.apply(init_fn)`` after the first step (the weights re-drawn in place, as a
    restart does), and the head's ``reset_parameters()`` after the second (few-shot and
    continual learning re-initialize the classifier): grad1 is the float64 loop's of the
    parameters as they are, at every step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            if step == 1:
                model.apply(_init)
            if step == 2:
                model[2].reset_parameters()
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- a weight-norm parametrization removed mid-training ----------------------------------------


def test_a_weight_norm_parametrization_removed_in_the_middle_of_training():
    """A layer trained under ``parametrizations.weight_norm`` (its ``original0`` and
    ``original1`` parameters), then ``remove_parametrizations(..., leave_parametrized=True)``
    after two steps (a new plain ``weight`` parameter) and a new optimizer: grad1 of whichever
    parameters the layer has is the float64 loop's at every step."""
    model = mlp()
    nn.utils.parametrizations.weight_norm(model[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=True)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
    assert "0.weight" in dict(model.named_parameters())


# -- a forward that fails half way, then the batch in halves ------------------------------------


class _Fragile(nn.Module):
    """A model whose forward fails after its first layer on a batch of more than 4 (a stand-in
    for running out of memory half way through the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        if x.shape[0] > 4:
            raise RuntimeError("out of memory (simulated)")
        return self.net[2](h)


def test_a_forward_out_of_memory_half_way_then_the_batch_in_halves():
    """The loops that catch an out-of-memory error (fairseq's ``train_step``, many scripts) and
    retry the batch in halves as micro-batches: the failed forward already ran the first
    layer's captured call. The halves' accumulation gives the float64 loop's sum, at each of two
    steps: the failed forward leaves nothing behind."""
    model = _Fragile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step, n=8)
            opt.zero_grad()
            with pytest.raises(RuntimeError, match="out of memory"):
                F.cross_entropy(model(x), y)
            want = None
            for xs, ys in zip(x.split(4), y.split(4)):
                got = loop_grad(model, F.cross_entropy, xs, ys)
                want = got if want is None else added(want, got)
                F.cross_entropy(model(xs), ys).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- a Sequential sliced into features and head -------------------------------------------------


def test_a_sequential_sliced_into_its_features_and_its_head():
    """``model[:-1](x)`` for the features (a new ``Sequential`` holding the hooked layers) and
    ``model[-1](features)`` for the logits, as feature-extraction code does: the hooked model
    itself is never called. grad1 and the DP step's norms are the float64 loop's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model[-1](model[:-1](x)), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
    x, y = batch(5)
    want = norms_of(loop_grad(model, F.cross_entropy, x, y))
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        losses = F.cross_entropy(model[-1](model[:-1](x)), y, reduction="none")
        got = gradhooks.dp_sgd_step(hooks, losses, max_norm=0.1, noise_multiplier=0.0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# -- a loss scaled by the gradient given to backward --------------------------------------------


def test_a_loss_scaled_by_the_gradient_given_to_its_backward():
    """A static loss scale given as the backward's gradient (``loss.backward(gradient=s)``,
    Megatron's and DeepSpeed's ``backward(loss * scale)`` written the other way) and unscaled
    on ``.grad`` before the step: grad1, like ``.grad`` before the unscale, is ``s`` times the
    float64 loop's; ``torch.autograd.backward`` with ``grad_tensors`` gives the same."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = 8.0
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = {n: scale * g for n, g in loop_grad(model, F.cross_entropy, x, y).items()}
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            s = torch.tensor(scale, dtype=D)
            if step % 2:
                torch.autograd.backward([loss], grad_tensors=[s])
            else:
                loss.backward(gradient=s)
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()


# -- one submodule's zero_grad ------------------------------------------------------------------


def test_the_heads_zero_grad_alone_restarts_its_grad1_alone():
    """A loop that zeroes only the head (``model.head.zero_grad()``) before each backward, the
    body's gradients left to accumulate (a linear probe written carelessly, or on purpose):
    the head's grad1 is each step's own, the body's the sum of every step's so far, as each
    one's ``.grad`` is."""
    model = mlp()
    with gradhooks.add_hooks(model):
        want = None
        for step in range(3):
            x, y = batch(step)
            got = loop_grad(model, F.cross_entropy, x, y)
            want = got if want is None else {
                n: want[n] + g if n.startswith("0.") else g for n, g in got.items()
            }  # fmt: skip
            model[2].zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")


# -- a forward for logging between a forward and its backward ----------------------------------


@pytest.mark.parametrize("grad", [True, False], ids=["grad enabled", "no_grad"])
def test_a_logging_forward_between_the_forward_and_its_backward(grad):
    """A loop that, between the training forward and its backward, runs the model on a
    held-out batch of another size for a metric: with grad enabled (the forgotten
    ``no_grad``: its graph is dropped unused) or under ``no_grad``. grad1 is the float64
    loop's of the training batch at each step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held_out, labels = batch(99, n=6)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            with torch.set_grad_enabled(grad):
                accuracy = (model(held_out).argmax(1) == labels).double().mean()
            assert 0 <= accuracy.item() <= 1
            loss.backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- a pipeline's schedule: every micro-batch forward, then the backwards in reverse ------------


def test_micro_batches_all_forwarded_then_backwarded_in_reverse():
    """GPipe's schedule on one device: every micro-batch's forward first (their graphs kept),
    then their backwards, last first, then the step. grad1 is the float64 loop's sum over the
    micro-batches, at each of two steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(2):
            micro = [batch(10 * step + i) for i in range(3)]
            want = None
            for x, y in micro:
                got = loop_grad(model, F.cross_entropy, x, y)
                want = got if want is None else added(want, got)
            opt.zero_grad()
            losses = [F.cross_entropy(model(x), y) for x, y in micro]
            for loss in reversed(losses):
                loss.backward()
            assert_grad1(model, want, f"step {step}")
            assert hooks.accumulated == 3
            opt.step()


# -- examples reweighted by their gradients' norms, a second forward of the batch ---------------


def test_examples_reweighted_by_their_gradient_norms_in_a_second_forward():
    """Importance sampling by the gradient's norm (Katharopoulos and Fleuret's "Not all samples
    are created equal"): a first forward and backward of the batch for the per-example norms,
    ``zero_grad``, then a second forward whose per-example losses are weighted by the norms
    (normalised to average 1) for the step. The norms are the float64 loop's, and after the
    second backward grad1's row ``i`` is the loop's times weight ``i``, at each step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(2):
            x, y = batch(step, n=8)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            norms = hooks.norms()
            torch.testing.assert_close(norms, norms_of(want), rtol=1e-9, atol=1e-12)
            weights = norms / norms.mean()
            opt.zero_grad()
            (F.cross_entropy(model(x), y, reduction="none") * weights).mean().backward()
            weighted = {n: g * weights.view(-1, *[1] * (g.dim() - 1)) for n, g in want.items()}
            assert_grad1(model, weighted, f"step {step}")
            opt.step()


# -- a batch chunked through the model and concatenated -----------------------------------------


def _chunked(model, x, y, how):
    """Each example's loss, the batch run through the model in two halves: the logits
    concatenated (``torch.cat([model(c) for c in x.chunk(2)])``), or the losses of ``x[:2]``
    and ``x[2:]``."""
    if how == "cat":
        return F.cross_entropy(torch.cat([model(c) for c in x.chunk(2)]), y, reduction="none")
    h = len(x) // 2
    halves = [
        F.cross_entropy(model(x[a:b]), y[a:b], reduction="none") for a, b in ((0, h), (h, None))
    ]
    return torch.cat(halves)


@pytest.mark.parametrize("how", ["cat", "halves"])
@pytest.mark.parametrize("step", ["grad1", "dp"])
def test_a_batch_chunked_through_the_model_in_one_backward_is_refused(how, step):
    """A batch run through the model in two chunks to save memory, in one backward: the hooks
    see two forwards of 2 examples each, whose row ``i`` would be taken for the same example
    (as two views of 2 examples are). Their inputs are other rows of one tensor, so the
    backward stops with a MixedExamplesError naming the rows and the tensor's shape, and writes
    no gradient, for grad1 as for the DP step; the next step, on the whole batch, is the
    loop's."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        losses = _chunked(model, x, y, how)
        with pytest.raises(gradhooks.MixedExamplesError, match=r"rows 2 to 3.*shape \(4, 3\)"):
            if step == "dp":
                gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
            else:
                losses.sum().backward()
        assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())
        x, y = batch(1)
        want = loop_grad(model, summed_ce, x, y)
        summed_ce(model(x), y).backward()
        assert_grad1(model, want, "the whole batch after")


class _TwoViews(nn.Module):
    """An encoder run on the two views of each example that the batch holds side by side
    (``x[:, 0]`` and ``x[:, 1]``, a siamese network's pairs), their outputs compared."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = mlp()

    def forward(self, x):
        return (self.enc(x[:, 0]) * self.enc(x[:, 1])).sum(1)


def test_forwards_on_the_same_rows_of_one_tensor_are_the_same_examples():
    """Two forwards of the hooked encoder in one backward on views of one tensor that hold
    the same examples (each example's two views, ``x[:, 0]`` and ``x[:, 1]``), and an RNN cell
    stepped over a sequence-first tensor (``x[t]``: the same examples at each time step) are not
    refused: grad1 is the loop's, over a few SGD steps."""
    pairs = _TwoViews()
    cell = nn.RNNCell(3, 4).to(D)

    def over_time(xs):
        h = torch.zeros(xs.shape[1], 4, dtype=D)
        for t in range(len(xs)):
            h = cell(xs[t], h)
        return h

    class _Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, xs):
            return over_time(xs.transpose(0, 1))

    for hooked, whole, make in (
        (pairs.enc, pairs, lambda g: torch.randn(4, 2, 3, generator=g, dtype=D)),
        (cell, _Seq(), lambda g: torch.randn(5, 4, 3, generator=g, dtype=D)),
    ):
        opt = torch.optim.SGD(hooked.parameters(), lr=0.1)
        with gradhooks.add_hooks(hooked, loss_reduction="sum"):
            for step in range(3):
                x = make(torch.Generator().manual_seed(step))
                batch_first = x if whole is pairs else x.transpose(0, 1)
                want = loop_grad(whole, lambda out: out.square().sum(), batch_first)
                want = {n.split(".", 1)[1]: g for n, g in want.items()}
                opt.zero_grad()
                (pairs(x) if whole is pairs else over_time(x)).square().sum().backward()
                assert_grad1(hooked, want, f"{type(hooked).__name__}, step {step}")
                opt.step()


def test_pairs_stored_in_two_halves_of_one_tensor_given_as_a_copy():
    """Each example a pair, the batch's first members in the first half of one tensor and the
    second members in the other: ``enc(x[:n])`` and ``enc(x[n:])`` are refused as chunks of one
    batch, and with the second half copied (``x[n:].clone()``, as the refusal advises) row
    ``i`` of each call is pair ``i``: grad1 is the loop's over the pairs."""
    pairs = _TwoViews()
    opt = torch.optim.SGD(pairs.parameters(), lr=0.1)
    with gradhooks.add_hooks(pairs.enc, loss_reduction="sum"):
        for step in range(3):
            p = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(step), dtype=D)
            want = loop_grad(pairs, lambda out: out.square().sum(), p)
            want = {n.split(".", 1)[1]: g for n, g in want.items()}
            x, n = torch.cat([p[:, 0], p[:, 1]]), len(p)
            opt.zero_grad()
            if step == 0:
                with pytest.raises(gradhooks.MixedExamplesError, match=r"x\[n:\]\.clone\(\)"):
                    (pairs.enc(x[:n]) * pairs.enc(x[n:])).sum(1).square().sum().backward()
                opt.zero_grad()
            (pairs.enc(x[:n]) * pairs.enc(x[n:].clone())).sum(1).square().sum().backward()
            assert_grad1(pairs.enc, want, f"step {step}")
            opt.step()


# -- hooks added between the micro-batches of an accumulation -----------------------------------


def test_hooks_added_between_two_micro_batches_and_check_says_so():
    """``add_hooks`` after the first micro-batch's backward, before the second's (a callback
    that turns per-example statistics on in the middle of a step): grad1 holds what the hooks
    saw, the second micro-batch's rows (the float64 loop's), while ``.grad`` holds both;
    ``hooks.check()`` raises, saying ``.grad`` holds a backward of a forward run before
    ``add_hooks``. After the next ``zero_grad`` the two agree again."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with gradhooks.add_hooks(model) as hooks:
        x, y = batch(1)
        want = loop_grad(model, F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, "the second micro-batch")
        with pytest.raises(gradhooks.CheckFailedError, match="before add_hooks"):
            hooks.check()
        opt.step()
        opt.zero_grad()
        x, y = batch(2)
        want = loop_grad(model, F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, "the next step")
        hooks.check()

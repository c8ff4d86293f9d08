"""Training-loop idioms, a twenty-fifth set: weights that are not the layer's own parameters,
parameters a step does not reach, and optimizers the earlier sets do not step.

Each test runs several steps of an ordinary loop with one of: recurrent weights kept
orthogonal by ``torch.nn.utils.parametrizations.orthogonal`` (an LSTM's, a GRU's), an LSTM's
projection under ``weight_norm``, and a parametrization put on after ``add_hooks``; AWD-LSTM's
weight drop on the recurrent weight written as a parametrization whose mask is drawn once a
step, into the DP step, and its ``WeightDrop`` as written (the LSTM's ``forward`` called
directly); parametrized projections inside ``nn.MultiheadAttention`` and the Transformer
layers (``weight_norm`` on ``out_proj``, ``orthogonal`` on ``in_proj_weight``, on a
feed-forward ``linear1``, on a decoder's cross-attention); an ``nn.LSTMCell`` stepped in time
with a parametrized weight; an auxiliary head used on
some steps only, with ``zero_grad(set_to_none=True)`` and ``False``; fairseq's LayerDrop
(whole layers skipped at random, once a step) into the DP step; deferred initialization (a
model built on the ``meta`` device, hooked, then ``to_empty`` and ``reset_parameters``); the
DP optimizer around ``RMSprop(centered=True)``, ``Adagrad``, ``NAdam``, ``RAdam`` and
``Adamax``; non-reentrant activation checkpointing of an orthogonal LSTM.

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), or with the DP step's clipped sum of those, or
with the same optimizer stepped on that sum; the LSTM and the attention layers with
parametrized weights are what was found and fixed (the LSTM's original got neither ``.grad``
nor ``grad1``, in silence; the attention layers were refused with a ``RuleError``, the LSTM
cell with a ``BatchNotFoundError``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, weight_norm
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    labelled_batch,
    labelled_sequences,
    one_thread,  # noqa: F401 (autouse in this module)
)

D = torch.float64
STEPS = 3


batch = functools.partial(labelled_batch, features=4, classes=3)
sequences = labelled_sequences


def twin(make, model: nn.Module) -> nn.Module:
    """A model from ``make()`` holding ``model``'s weights now, for the loop (a deep copy of a
    parametrized recurrent layer after a forward fails in torch: its flat weights are not
    leaves)."""
    other = make()
    other.load_state_dict(model.state_dict())
    return other


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    """Every trainable parameter's ``grad1`` (and ``.grad``, its mean) is the loop's."""
    checked = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert "grad1" in p.__dict__, f"{what}: {n} has no grad1"
            assert p.grad is not None, f"{what}: {n} has no .grad"
            assert_close(p.grad1, want[n], f"{what}: {n}")
            assert_close(p.grad1.mean(0), p.grad, f"{what}: {n} (mean)")
            checked += 1
    assert checked == len(want), what


def clipped_sum(want: dict, max_norm: float) -> dict:
    """Each example's whole-model gradient clipped to ``max_norm``, summed over the batch."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    factor = (max_norm / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factor, g) for n, g in want.items()}


# -- recurrent weights that a parametrization makes -------------------------------------------


class Recurrent(nn.Module):
    """A recurrent layer over ``[batch, time, 4]`` and a head on its last output."""

    def __init__(self, kind: str = "LSTM", **options) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = getattr(nn, kind)(4, 4, batch_first=True, **options)
        self.head = nn.Linear(self.rnn.proj_size or 4, 3) if kind == "LSTM" else nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


PARAMETRIZED = {
    "lstm-orthogonal-hh": (
        lambda: Recurrent("LSTM").to(D), lambda m: orthogonal(m.rnn, "weight_hh_l0")),
    "gru-orthogonal-hh": (
        lambda: Recurrent("GRU").to(D), lambda m: orthogonal(m.rnn, "weight_hh_l0")),
    "lstm-proj-weight-norm": (
        lambda: Recurrent("LSTM", proj_size=2).to(D), lambda m: weight_norm(m.rnn, "weight_hr_l0")),
}  # fmt: skip


@pytest.mark.parametrize("when", ["before-add_hooks", "after-add_hooks"])
@pytest.mark.parametrize("case", list(PARAMETRIZED))
def test_recurrent_weights_made_by_a_parametrization_train_as_the_loop(case, when):
    """expRNN's habit: the recurrent weight kept orthogonal by ``orthogonal(rnn,
    "weight_hh_l0")`` (or an LSTM's projection under ``weight_norm``), put on before
    ``add_hooks`` or after it, between two steps; Adam steps the originals. The LSTM ran its
    call with grad mode off (its rule's own backward through time), so the weight the
    parametrization made inside the call had no graph to its original: the original got
    neither ``.grad`` nor ``grad1``, in silence (``check()`` said ok), and did not train.
    Now ``grad1`` and ``.grad`` are the loop's for every parameter at every step."""
    build, put_on = PARAMETRIZED[case]

    def make():
        model = build()
        put_on(model)
        return model

    model = make() if when == "before-add_hooks" else build()
    with gradhooks.add_hooks(model):
        if when == "after-add_hooks":
            x, y = sequences(99)
            F.cross_entropy(model(x), y).backward()  # (a step before it)
            model.zero_grad()
            put_on(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for step in range(STEPS):
            x, y = sequences(step)
            want = loop_grad(twin(make, model), F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class DropConnect(nn.Module):
    """AWD-LSTM's weight drop as a parametrization: the weight times a mask the loop draws once
    a step (``None``: the weight as it is, for evaluation)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, w):
        return w if self.mask is None else w * self.mask


def weight_dropped() -> Recurrent:
    model = Recurrent("LSTM").to(D)
    parametrize.register_parametrization(model.rnn, "weight_hh_l0", DropConnect())
    return model


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_awd_lstm_weight_drop_as_a_parametrization_into_the_dp_step(method):
    """salesforce/awd-lstm-lm's ``WeightDrop`` written as a parametrization of the LSTM's
    recurrent weight, its mask (keep 0.7, scaled) drawn once a step and the same for every
    example, into the DP step (no noise): ``.grad`` is the clipped mean of the loop's
    gradients, the recurrent weight's share among them (it was left out: its ``.grad`` zero,
    the other parameters clipped by norms that did not count it)."""
    model = weight_dropped()
    drop = model.rnn.parametrizations.weight_hh_l0[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(7)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(STEPS):
            x, y = sequences(10 + step)
            drop.mask = (torch.rand(16, 4, generator=g) < 0.7).to(D) / 0.7
            reference = twin(weight_dropped, model)
            reference.rnn.parametrizations.weight_hh_l0[0].mask = drop.mask
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.3, noise_multiplier=0.0, method=method)
            params = dict(model.named_parameters())
            for n, s in clipped_sum(want, 0.3).items():
                assert_close(params[n].grad, s / 5, f"step {step}: {n}")
            assert params["rnn.parametrizations.weight_hh_l0.original"].grad.abs().sum() > 0
            opt.step()


class AwdWeightDrop(nn.Module):
    """salesforce/awd-lstm-lm's ``WeightDrop`` as written: the weight moved to ``<name>_raw``
    on the LSTM, ``<name>`` set from it by ``F.dropout`` before each call, and the LSTM's
    ``forward`` called directly (not as a module). The mask is drawn from ``seed``, which the
    loop sets once a step, so that every forward of the step (the loop's too) draws the same."""

    def __init__(self, module: nn.Module, name: str, p: float) -> None:
        super().__init__()
        self.module, self.name, self.p, self.seed = module, name, p, 0
        raw = getattr(module, name)
        del module._parameters[name]
        module.register_parameter(f"{name}_raw", nn.Parameter(raw.detach().clone()))

    def forward(self, *args):
        raw = getattr(self.module, f"{self.name}_raw")
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            setattr(self.module, self.name, F.dropout(raw, p=self.p, training=self.training))
        return self.module.forward(*args)


class AwdLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = AwdWeightDrop(nn.LSTM(4, 4, batch_first=True), "weight_hh_l0", p=0.3)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_awd_lstm_weight_drop_as_written_trains_as_the_loop():
    """The original ``WeightDrop``: the LSTM is not called as a module (its ``forward``
    directly), so no hook sees its call, and its weights meet the batch inside it. ``grad1``
    of every parameter (``weight_hh_l0_raw`` through the dropped weight) and ``.grad`` are
    the loop's at every step, with a new mask each step."""
    model = AwdLstm().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            model.rnn.seed = 100 + step
            x, y = sequences(90 + step)
            reference = AwdLstm().to(D)
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    q.copy_(p)
            reference.rnn.seed = model.rnn.seed
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- parametrized projections inside the layers whose rules own their children ----------------


class Attention(nn.Module):
    """Self-attention over ``[batch, time, 4]`` and a head on its mean over time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


class Decoder(nn.Module):
    """A decoder layer whose memory is the first three steps of the input, mapped."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.memory = nn.Linear(4, 4)
        self.layer = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.layer(x, self.memory(x[:, :3])).mean(1))


ATTENTION = {
    "mha-out_proj-weight-norm": (Attention, lambda m: weight_norm(m.attention.out_proj)),
    "mha-in_proj-orthogonal": (Attention, lambda m: orthogonal(m.attention, "in_proj_weight")),
    "encoder-linear1-weight-norm": (Encoder, lambda m: weight_norm(m.layer.linear1)),
    "decoder-cross-attention-and-linear2": (
        Decoder, lambda m: (weight_norm(m.layer.multihead_attn.out_proj), orthogonal(m.layer.linear2))),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ATTENTION))
def test_parametrized_projections_inside_attention_and_transformer_layers(case):
    """``weight_norm`` on a ``MultiheadAttention``'s ``out_proj``, ``orthogonal`` on its
    ``in_proj_weight``, on a Transformer layer's feed-forward or on a decoder's cross-attention:
    the rules of these layers take every parameter below them, and the parametrizations'
    originals, which they do not know, made the backward a ``RuleError``. Now each
    parametrization is a target of its own, as under any other layer, and ``grad1`` and
    ``.grad`` are the loop's at every step."""
    cls, put_on = ATTENTION[case]

    def make():
        model = cls().to(D)
        put_on(model)
        return model

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = sequences(20 + step)
            want = loop_grad(twin(make, model), F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class CellInTime(nn.Module):
    """An ``nn.LSTMCell`` stepped over ``[batch, time, 4]`` by hand, a head on the last state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.LSTMCell(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0])


@pytest.mark.parametrize("weight", ["weight_hh", "weight_ih"])
def test_an_lstm_cell_stepped_in_time_with_an_orthogonal_weight(weight):
    """``orthogonal(cell, "weight_hh")`` (or ``"weight_ih"``) on an ``nn.LSTMCell`` stepped in
    time by hand. The weight the parametrization makes meets the batch in ``lstm_cell``, which
    torch runs on the CPU as several autograd nodes, ``c'`` among the inputs of ``h'``: the
    per-example shares taken again at each output's node counted the gradient ``h'`` passes to
    ``c'`` twice, and the check refused the sum (a ``BatchNotFoundError``). Now ``grad1`` and
    ``.grad`` are the loop's at every step."""

    def make():
        model = CellInTime().to(D)
        orthogonal(model.cell, weight)
        return model

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = sequences(30 + step)
            want = loop_grad(twin(make, model), F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- parameters a step does not reach ---------------------------------------------------------


class DeeplySupervised(nn.Module):
    """A body, a head, and an auxiliary head on the body's features used on some steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.aux = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, with_aux: bool):
        h = torch.tanh(self.body(x))
        return self.head(h) + 0.5 * self.aux(h) if with_aux else self.head(h)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_an_auxiliary_head_used_on_some_steps_only(set_to_none):
    """Deep supervision switched on every other step, ``zero_grad(set_to_none=...)`` between:
    on a step without it the auxiliary head has no ``.grad`` and no ``grad1``
    (``set_to_none=True``) or zeros in both (``False``), never the last step's; the other
    parameters' are the loop's, and so are all of them on the steps that use it."""
    model = DeeplySupervised().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(4):
            with_aux = step % 2 == 0
            x, y = batch(40 + step)
            reference = DeeplySupervised().to(D)
            reference.load_state_dict(model.state_dict())
            want = loop_grad(reference, F.cross_entropy, (x, with_aux), y)
            opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(x, with_aux), y).backward()
            for n, p in model.named_parameters():
                if n.startswith("aux.") and not with_aux:
                    if set_to_none:
                        assert p.grad is None and "grad1" not in p.__dict__, n
                    else:
                        assert p.grad is not None and not p.grad.any(), n
                        assert p.grad1.shape == (5, *p.shape) and not p.grad1.any(), n
                    continue
                assert_close(p.grad1, want[n], f"step {step}: {n}")
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} (mean)")
            opt.step()


class LayerDrop(nn.Module):
    """fairseq's LayerDrop: residual layers, each skipped for the whole batch with probability
    ``p`` at a training forward (the loop draws which, once a step, and passes them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x, keep: tuple[bool, ...]):
        h = self.embed(x)
        for layer, kept in zip(self.layers, keep):
            if kept:
                h = h + torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.parametrize("method", ["grad1", "ghost"])
def test_layerdrop_skips_whole_layers_into_the_dp_step(method):
    """Layers skipped at random for the whole batch (at least one each step): the DP step's
    ``.grad`` is the clipped mean of the loop's gradients, whose norms count only the layers
    that ran; a skipped layer's ``.grad`` is zero (no noise), and SGD leaves it as it was."""
    model = LayerDrop().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    quantity = "grad1" if method == "grad1" else "norms"
    skipped = 0
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(STEPS):
            keep = tuple(bool(k) for k in torch.rand(3, generator=g) > 0.4)
            keep = keep if not all(keep) else (False, *keep[1:])
            skipped += keep.count(False)
            x, y = batch(50 + step)
            reference = LayerDrop().to(D)
            reference.load_state_dict(model.state_dict())
            want = loop_grad(reference, lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                             (x, keep), y)  # fmt: skip
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            losses = F.cross_entropy(model(x, keep), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, method=method)
            sums = clipped_sum(want, 0.5)
            for n, p in model.named_parameters():
                if n.startswith("layers.") and not keep[int(n.split(".")[1])]:
                    assert not want[n].any(), n  # (the loop: it never ran)
                    assert p.grad is None or not p.grad.any(), f"step {step}: {n}"
                    continue
                assert_close(p.grad, sums[n] / 5, f"step {step}: {n}")
            opt.step()
            for i, kept in enumerate(keep):
                if not kept:
                    for name in (f"layers.{i}.weight", f"layers.{i}.bias"):
                        assert torch.equal(dict(model.named_parameters())[name], before[name])
    assert skipped


# -- deferred initialization on the meta device -----------------------------------------------


def test_a_model_built_on_the_meta_device_hooked_then_materialized():
    """torchtitan's deferred initialization: the model built under ``torch.device("meta")``,
    hooked, then ``to_empty(device="cpu")`` and each layer's ``reset_parameters`` (new
    parameters in the slots); the steps after it give the loop's ``grad1``."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    with gradhooks.add_hooks(model):
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(STEPS):
            x, y = batch(60 + step)
            reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
            reference.load_state_dict(model.state_dict())
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- the DP optimizer around optimizers the earlier sets do not step --------------------------


OPTIMIZERS = {
    "RMSprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.5),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "NAdam-decoupled": lambda ps: torch.optim.NAdam(ps, lr=0.05, weight_decay=0.1,
                                                    decoupled_weight_decay=True),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.05),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.05),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_dp_optimizer_around_optimizers_with_state_of_their_own(name):
    """:class:`gradhooks.DPOptimizer` around an optimizer that keeps running averages or sums
    of the gradient: each step moves the weights exactly as the same optimizer, stepping a
    twin of the model on the clipped mean of the loop's gradients, moves the twin's."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    twin_model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    twin_model.load_state_dict(model.state_dict())
    twin_opt = OPTIMIZERS[name](twin_model.parameters())
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            OPTIMIZERS[name](model.parameters()), h, max_grad_norm=0.4, noise_multiplier=0.0,
            expected_batch_size=5,
        )  # fmt: skip
        for step in range(STEPS):
            x, y = batch(70 + step)
            want = loop_grad(twin_model, lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                             x, y)  # fmt: skip
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
            for n, p in twin_model.named_parameters():
                p.grad = clipped_sum(want, 0.4)[n] / 5
            twin_opt.step()
            for (n, p), q in zip(model.named_parameters(), twin_model.parameters()):
                assert_close(p.detach(), q.detach(), f"step {step}: {n}")


# -- non-reentrant checkpointing of a parametrized LSTM ---------------------------------------


class Checkpointed(nn.Module):
    """An orthogonal LSTM run under ``checkpoint(..., use_reentrant=False)``, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Recurrent("LSTM")
        orthogonal(self.inner.rnn, "weight_hh_l0")

    def forward(self, x):
        return self.inner.head(
            checkpoint(lambda t: self.inner.rnn(t)[0][:, -1], x, use_reentrant=False)
        )


def test_non_reentrant_checkpointing_of_an_orthogonal_lstm():
    """The LSTM and its parametrization run again at the backward (``use_reentrant=False``, the
    default torch recommends): ``grad1`` and ``.grad`` are the loop's at every step."""

    def make():
        return Checkpointed().to(D)

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = sequences(80 + step)
            want = loop_grad(twin(make, model), F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()

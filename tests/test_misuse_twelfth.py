"""Mistakes in how a model is written and trained, a twelfth set: a recurrent weight made by the
old ``torch.nn.utils.weight_norm`` or by AWD-LSTM's ``WeightDrop`` calling the LSTM as a module;
a per-example function ``torch.vmap``-ed over the batch inside the forward; a layer's weight
made from a statistic of the batch (by a hypernetwork given the batch mean, by a
parametrization given the batch's spread); ``batch_first`` forgotten on an ``nn.LSTM``, an
``nn.GRU`` or an ``nn.MultiheadAttention`` given ``[batch, time, features]``; a ``view`` in
place of a transpose (an LSTM's final state flattened, a batch made time-major); and a hidden
state carried to the next batch without ``detach`` (found and fixed: with the hooks the
backward went on in silence through the freed graph of the last batch). Each stops with the
typed error of its kind, whose message names the module or the parameter, leaving the
parameters, ``.grad``, ``grad1``, the buffers, the hooks and the training flags as they were
(or, for torch's own error, as torch leaves them without the hooks), and the model written the
right way trains as the per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`) says
(``tests/test_misuse.py`` to ``tests/test_misuse_eleventh.py`` hold the earlier sets)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_twentyfifth import assert_grad1
from test_misuse_fifth import assert_all_untouched, close, full_state
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import gradhooks
from gradhooks.oracle import loop_grad
from harness import labelled_batch, labelled_sequences, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


batch = functools.partial(labelled_batch, features=4, classes=3)
sequences = labelled_sequences


def trains_as_the_loop(make, data, steps: int = 2) -> None:
    """``make()``'s model, hooked, trained ``steps`` steps of SGD on ``data(step)``: ``grad1``
    and ``.grad`` the loop's at each (the loop given a model from ``make()`` with the same
    weights)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(steps):
            x, y = data(step)
            reference = make()
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    q.copy_(p)
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def refused(model: nn.Module, error: type, says: list[str], data) -> None:
    """The mistake in a first step of SGD on ``data(0)``: its forward or its backward stops
    with ``error`` naming ``says``, the model as it was before it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        x, y = data(0)
        opt.zero_grad()
        before = full_state(model)
        raised(error, says, lambda: F.cross_entropy(model(x), y).backward())
        assert_all_untouched(model, before)


# -- a recurrent weight made by a forward pre-hook or by a wrapper ----------------------------


class WeightDrop(nn.Module):
    """salesforce/awd-lstm-lm's ``WeightDrop``: the weight moved to ``<name>_raw`` on the wrapped
    module, and ``<name>`` set from it (dropped, here with ``p = 0``) before each call, which
    calls the wrapped module as a module (the original calls its ``forward`` directly)."""

    def __init__(self, module: nn.Module, name: str, p: float = 0.0) -> None:
        super().__init__()
        self.module, self.name, self.p = module, name, p
        raw = getattr(module, name)
        del module._parameters[name]
        module.register_parameter(f"{name}_raw", nn.Parameter(raw.detach().clone()))

    def forward(self, *args):
        raw = getattr(self.module, f"{self.name}_raw")
        setattr(self.module, self.name, F.dropout(raw, p=self.p, training=self.training))
        return self.module(*args)


class Recurrent(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        lstm = nn.LSTM(4, 4, batch_first=True)
        if how == "old-weight_norm":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # (deprecated, still used)
                lstm = nn.utils.weight_norm(lstm, "weight_hh_l0")
        elif how == "weight-drop-wrapper":
            lstm = WeightDrop(lstm, "weight_hh_l0")
        elif how == "parametrizations.weight_norm":
            weight_norm(lstm, "weight_hh_l0")
        self.rnn, self.head = lstm, nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize(
    "how, says",
    [("old-weight_norm", ["'rnn' (LSTM)", "'weight_hh_l0_g'", "parametrizations.weight_norm"]),
     ("weight-drop-wrapper", ["'rnn.module' (LSTM)", "'weight_hh_l0_raw'"])],
    ids=["old-weight_norm", "weight-drop-wrapper"],
)  # fmt: skip
def test_a_recurrent_weight_made_before_each_call_is_refused_naming_its_parameters(how, says):
    """The LSTM's ``weight_hh_l0`` made before each call from parameters the LSTM's rule does
    not know: by the deprecated ``torch.nn.utils.weight_norm`` (a forward pre-hook, from
    ``weight_hh_l0_g`` and ``_v``) or by a weight-drop wrapper that sets it from
    ``weight_hh_l0_raw`` and calls the LSTM. The backward is refused with a ``RuleError``
    naming the layer and the parameter (and, for the pre-hook, the parametrization to use),
    the model as it was; written with ``torch.nn.utils.parametrizations.weight_norm`` the
    LSTM trains as the loop says."""
    refused(Recurrent(how).to(D), gradhooks.RuleError, says, sequences)
    trains_as_the_loop(lambda: Recurrent("parametrizations.weight_norm").to(D), sequences)


# -- a per-example function vmapped over the batch inside the forward -------------------------


class Vmapped(nn.Module):
    """A first layer run on each example by ``torch.vmap`` inside the forward (or as usual)."""

    def __init__(self, vmapped: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vmapped = vmapped
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        if self.vmapped:
            h = torch.vmap(lambda row: torch.tanh(self.a(row)))(x)
        else:
            h = torch.tanh(self.a(x))
        return self.b(h)


def test_a_layer_vmapped_over_the_batch_inside_the_forward_is_refused():
    """``torch.vmap`` over the batch inside the forward hides the examples from the hooks: the
    layer after it gets an input that, as far as they can tell, depends on no example. The
    backward is refused (:class:`gradhooks.BatchNotFoundError`, naming ``'b'``), the model as
    it was; the same layer called on the batch trains as the loop says."""
    refused(Vmapped(True).to(D), gradhooks.BatchNotFoundError, ["'b' (Linear)"], batch)
    trains_as_the_loop(lambda: Vmapped(False).to(D), batch)


# -- a weight made from a statistic of the batch ----------------------------------------------


class Hyper(nn.Module):
    """A head whose weight a hypernetwork makes from the body's features: their batch mean
    (each example's loss reaches every other's features), or each example's own."""

    def __init__(self, per_example: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.per_example = per_example
        self.body, self.gen = nn.Linear(4, 4), nn.Linear(4, 3 * 4)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.per_example:
            w = self.gen(h).view(-1, 3, 4)
            return torch.einsum("b o i, b i -> b o", w, h)
        return F.linear(h, self.gen(h.mean(0)).view(3, 4))


class BySpread(nn.Module):
    """A parametrization that scales the weight by a number the model's forward sets."""

    def __init__(self) -> None:
        super().__init__()
        self.scale: torch.Tensor | float = 1.0

    def forward(self, w):
        return w * self.scale


class Spread(nn.Module):
    """A head whose weight is scaled by the spread of the body's features: their standard
    deviation over the whole batch, or each example's (as an input, per row)."""

    def __init__(self, per_example: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.per_example = per_example
        self.body, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        parametrize.register_parametrization(self.head, "weight", BySpread())

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.per_example:
            return self.head(h * h.std(1, keepdim=True))
        self.head.parametrizations.weight[0].scale = h.std()
        return self.head(h)


@pytest.mark.parametrize(
    "make, error, says",
    [(Hyper, gradhooks.MixedExamplesError, ["'gen' (Linear)", "mean"]),
     (Spread, gradhooks.BatchNotFoundError, ["'head.parametrizations.weight'",
                                             "an attribute set by another module"])],
    ids=["hypernetwork-of-the-batch-mean", "parametrization-of-the-batch-spread"],
)  # fmt: skip
def test_a_weight_made_from_a_statistic_of_the_batch_is_refused(make, error, says):
    """A head's weight made from the whole batch's features (a hypernetwork given their mean,
    a parametrization given their standard deviation through an attribute): each example's
    loss depends on every other example, and no per-example gradient exists. Refused, naming
    the module, the model as it was; made from each example's own features, the model trains
    as the loop says."""
    refused(make(False).to(D), error, says, batch)
    trains_as_the_loop(lambda: make(True).to(D), batch)


# -- batch_first forgotten --------------------------------------------------------------------


class Sequence(nn.Module):
    """A recurrent layer or self-attention over ``[batch, time, 4]``, the head on the last
    step's output (``[:, -1]``: the last example, where the layer took dimension 0 for time)."""

    def __init__(self, kind: str, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "MultiheadAttention":
            self.layer = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        else:
            self.layer = getattr(nn, kind)(4, 4, batch_first=batch_first)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        if self.kind == "MultiheadAttention":
            return self.head(self.layer(x, x, x, need_weights=False)[0][:, -1])
        return self.head(self.layer(x)[0][:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "MultiheadAttention"])
def test_batch_first_forgotten_on_a_sequence_layer_is_refused(kind):
    """``nn.LSTM(4, 4)`` (or a GRU, or ``nn.MultiheadAttention``) without ``batch_first=True``,
    given ``[batch, time, features]``: the layer runs along the batch as its time (or attends
    across the examples), and ``[:, -1]`` picks one example's states for every row. Refused
    (:class:`gradhooks.MixedExamplesError`, naming the head that gets them, the dimension taken
    for the batch and the layer that took it, and pointing at ``batch_first``), the model as it
    was; with ``batch_first=True`` it trains as the loop says."""
    says = ["'head' (Linear)", "dimension 1 of the model's first input"]
    says += [f"'layer' ({kind})", "batch_first=True"]
    refused(Sequence(kind, False).to(D), gradhooks.MixedExamplesError, says, sequences)
    trains_as_the_loop(lambda: Sequence(kind, True).to(D), sequences)


# -- a reshape in place of a transpose ---------------------------------------------------------


class Reshaped(nn.Module):
    """An LSTM whose input or final state is laid out by ``view`` where the layout needs a
    transpose (``right=False``), or by the transpose (``right=True``)."""

    def __init__(self, where: str, right: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where, self.right = where, right
        if where == "final-state":
            self.rnn, self.head = nn.LSTM(4, 4, num_layers=2, batch_first=True), nn.Linear(8, 3)
        else:
            self.rnn, self.head = nn.LSTM(4, 4), nn.Linear(4, 3)  # (time-major)

    def forward(self, x):
        batch, time = x.shape[:2]
        if self.where == "final-state":
            _, (h, _) = self.rnn(x)  # (h: [layers, batch, hidden])
            h = h.transpose(0, 1).reshape(batch, -1) if self.right else h.view(batch, -1)
            return self.head(h)
        x = x.transpose(0, 1) if self.right else x.view(time, batch, -1)
        return self.head(self.rnn(x)[0][-1])


@pytest.mark.parametrize(
    "where, says",
    [("final-state", "'head' (Linear)"), ("time-major-input", "'rnn' (LSTM)")],
    ids=["h_n.view(batch, -1)", "x.view(time, batch, -1)"],
)  # fmt: skip
def test_a_view_in_place_of_a_transpose_is_refused(where, says):
    """A two-layer LSTM's final state ``[layers, batch, hidden]`` flattened by
    ``h_n.view(batch, -1)``, or a batch made time-major by ``x.view(time, batch, -1)``: the
    shapes fit, and each row now holds parts of several examples. Refused
    (:class:`gradhooks.MixedExamplesError`, naming the layer that gets them), the model as it
    was; with the transpose the model trains as the loop says."""
    refused(Reshaped(where, False).to(D), gradhooks.MixedExamplesError, [says], sequences)
    trains_as_the_loop(lambda: Reshaped(where, True).to(D), sequences)


# -- a hidden state carried to the next batch without detach ----------------------------------


class LanguageModel(nn.Module):
    """pytorch/examples' word_language_model, small: an LSTM whose state (``h``, ``c``, given
    and returned as ``[batch, hidden]``) goes on from batch to batch, a decoder on the last
    step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.decoder = nn.LSTM(4, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x, h=None, c=None):
        out, (h, c) = self.rnn(x, None if h is None else (h[None], c[None]))
        return self.decoder(out[:, -1]), h[0], c[0]


def first_batch_then_the_next(model: nn.Module, step: bool):
    """The first batch's step (an SGD step, or none), ``zero_grad``, the next batch's forward
    from the first one's state, not detached: the next loss, the state, the optimizer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = sequences(0)
    out, h, c = model(x)
    F.cross_entropy(out, y).backward()
    if step:
        opt.step()
    opt.zero_grad()
    x, y = sequences(1)
    out, _, _ = model(x, h, c)
    return F.cross_entropy(out, y), (h, c), opt


@pytest.mark.parametrize("step", [True, False], ids=["after-a-step", "without-a-step"])
def test_a_hidden_state_not_detached_stops_as_it_does_without_the_hooks(step):
    """The state carried to the next batch without ``repackage_hidden`` (``detach``): the
    next backward goes into the last batch's graph, which its backward freed. torch stops it
    ("Trying to backward through the graph a second time"). With the hooks the LSTM's call
    runs without autograd (its rule's backward through time in place of torch's), and the one
    node that joins it to its parameters kept nothing to free: the backward went on in
    silence through the last batch, as with ``retain_graph=True`` (or, after the optimizer's
    step, stopped with a ``StateError`` about the weights' versions). Now it stops with
    torch's error, the weights and ``.grad`` what torch leaves without the hooks (the
    decoder's and the LSTM's of the new batch, accumulated before the backward reached the
    old one); the loop's fix, the state detached, then gives the loop's ``grad1``."""
    plain = LanguageModel().to(D)
    loss, _, _ = first_batch_then_the_next(plain, step)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    model = LanguageModel().to(D)
    with gradhooks.add_hooks(model):
        loss, (h, c), opt = first_batch_then_the_next(model, step)
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
            loss.backward()
        assert type(e.value) is RuntimeError, repr(e.value)
        params = dict(model.named_parameters())
        for n, p in plain.named_parameters():
            close(params[n].detach(), p.detach(), f"{n}")
            if p.grad is None:
                assert params[n].grad is None, n
            else:
                close(params[n].grad, p.grad, f".grad of {n}")
        h, c = h.detach(), c.detach()  # (repackage_hidden)
        x, y = sequences(1)
        reference = LanguageModel().to(D)
        reference.load_state_dict(model.state_dict())
        want = loop_grad(reference, lambda out, t: F.cross_entropy(out[0], t), (x, h, c), y)
        opt.zero_grad()
        out, _, _ = model(x, h, c)
        F.cross_entropy(out, y).backward()
        assert_grad1(model, want, "the state detached")

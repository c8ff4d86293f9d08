"""An eighth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd, of
``torch.func.functional_call`` where the peer's case runs through it, and
:mod:`gradhooks.oracle`). The first seven sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third`, :mod:`test_peer_suites_fourth`,
:mod:`test_peer_suites_fifth`, :mod:`test_peer_suites_sixth` and
:mod:`test_peer_suites_seventh`; this one adds:

- torch's ``functional_call`` tests (``test/test_stateless.py``): a module whose bias and buffer
  are each held under two names (``tie_weights`` on and off), some weights given and a bias
  given as ``None``, the original of a parametrization given in place of the module's (weight
  norm, spectral norm, a parametrization of one's own), a BatchNorm's running statistics
  given (also to a BatchNorm of a learned token every example shares), a mask buffer and a
  parametrization's buffers given to modules without a rule, a ``strict`` call refused by
  torch; and, as functorch's per-sample-gradient recipe
  uses it, every layer family with all its parameters given, and a language model whose
  embedding is tied to its output layer;
- torch's parametrization tests (``test/nn/test_parametrization.py``): two parametrizations
  chained on one weight and one on a bias (also under ``parametrize.cached()``), a
  parametrization moved to another module by ``transfer_parametrizations_and_params`` (one
  original shared by both), an ``unsafe`` one whose original has another shape, spectral and
  weight norm of (transposed) convolutions in training, and one on a frozen weight;
- torch's ExpandedWeights tests (``test/test_expanded_weights.py``, ``test_group_norm_error``):
  ``F.group_norm`` over channels its groups do not divide, torch's own error under the hooks;
- Opacus (``opacus/tests/validators/lstm_test.py``, ``gru_test.py``,
  ``multihead_attention_test.py``, ``opacus/tests/dp_layers/dp_rnn_test.py``):
  ``ModuleValidator.fix`` turning ``nn.LSTM``, ``nn.GRU`` and ``nn.MultiheadAttention`` into
  Opacus' own ``DPLSTM`` / ``DPGRU`` (layers of ``RNNLinear`` cells stepped in Python) and
  ``DPMultiheadAttention`` (a Linear per projection), whose ``grad1`` is the loop's and the
  same as the torch layer's, batch-first and time-major (``batch_dim=1``), with an initial
  state, layers and directions, appended key and value biases and zero attention;
- jax-privacy (``jax_privacy/experimental/clipping_test.py``, ``microbatching_test.py``): the
  clipped sum's sensitivity to one example replaced, removed or turned into padding (by every
  clipping method), and the clipped sum of a batch taken by micro-batches of 1, 2, 5 and 10
  (padding examples adding nothing);
- Opacus (``opacus/tests/multigpu_gradcheck_test.py``, the step each process takes): soft
  labels from ``randn`` under ``CrossEntropyLoss``, a bound that clips nothing and no noise,
  one DP step by every clipping (flat, per layer, ghost, book-keeping) equal to plain SGD;
- pytorch-sso (``tests/test_batched_grads.py``, ``tests/test_samplegrad.py``): a transposed
  convolution given ``output_size`` in 1-d to 3-d autoencoders, and its ``LeNet5BatchNorm``
  (refused in training, the loop's in eval).

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import parametrize

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    assert_untouched,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    seeded,
    sq,
)

D = torch.float64


def _rows(x: Tensor, i: int):
    return x[i : i + 1]


def functional_loop(model: nn.Module, given: dict, x: Tensor, **kw) -> dict[str, Tensor]:
    """Per-example gradients of ``sq(functional_call(model, given, x[i:i+1], **kw))``, by
    autograd one example at a time: for every tensor of ``given`` that requires grad (a tensor
    given under two names is one leaf, its uses summed) and every trainable parameter of the
    model's that ``given`` leaves in place, by name; ``None`` for one the output does not
    reach."""
    model_params = dict(model.named_parameters())
    names = [n for n, t in given.items() if isinstance(t, Tensor) and t.requires_grad]
    kept = [n for n, p in model_params.items() if n not in given and p.requires_grad]
    rows: dict[str, list] = {n: [] for n in names + kept}
    for i in range(x.shape[0]):
        leaves = {}
        for n in names:
            t = given[n]
            leaves.setdefault(id(t), t.detach().requires_grad_())
        one = {n: leaves[id(t)] if n in names else t for n, t in given.items()}
        wrt = [leaves[id(given[n])] for n in names] + [model_params[n] for n in kept]
        loss = sq(functional_call(model, one, (_rows(x, i),), **kw))
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        for n, g in zip(names + kept, grads, strict=True):
            rows[n].append(g)
    return {n: None if r[0] is None else torch.stack(r) for n, r in rows.items()}


def check_functional_call(model: nn.Module, given: dict, x: Tensor, what: str, **kw) -> None:
    """One backward of the hooked model through ``functional_call(model, given, x)``: each
    given tensor that requires grad, and each of the model's trainable parameters left in
    place, has the loop's ``grad1`` (none where the output does not reach it); the model's
    parameters that were replaced get none."""
    want = functional_loop(model, given, x, **kw)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(functional_call(model, given, (x,), **kw)).backward()
    params = dict(model.named_parameters())
    for n, w in want.items():
        t = given[n] if n in given else params[n]
        if w is None:
            assert getattr(t, "grad1", None) is None, f"{what}: {n} got a grad1 it has no use for"
            continue
        assert hasattr(t, "grad1"), f"{what}: {n} has no grad1"
        assert_close(t.grad1, w, f"{what}: {n}")
    for n, p in params.items():
        if n in given and not any(p is t for t in given.values()):
            assert not hasattr(p, "grad1"), f"{what}: the model's own {n}, replaced, got a grad1"


def perturbed(model: nn.Module, names=None, seed: int = 5) -> dict[str, Tensor]:
    """Other values for the model's parameters (``names``, or all of them, a tied one under
    each of its names): new leaves that require grad, as a meta-learner's or a checkpoint's
    weights given to ``functional_call``."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)).requires_grad_()
        for n, p in model.named_parameters(remove_duplicate=False)
        if names is None or n in names
    }


# == torch: test/test_stateless.py, functional_call ==============================================


class TiedModule(nn.Module):
    """torch's ``MockTiedModule``: a Linear's bias held a second time by the parent, and a
    buffer held under two names, all used in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 2)
        self.tied_bias = self.l1.bias
        self.buffer = nn.Buffer(torch.ones(2))
        self.tied_buffer = self.buffer

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.l1(x)) * (self.tied_bias + self.buffer + self.tied_buffer)


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
def test_stateless_functional_call_of_a_module_with_tied_bias_and_buffer(tie_weights):
    """pytorch/pytorch ``test/test_stateless.py`` (``MockTiedModule``, ``test_tied_weights``,
    ``tie_weights``): with ``tie_weights=True`` a bias given under one of its two names is used
    under both (its ``grad1`` sums the Linear's use and the parent's); with ``False`` each name
    takes its own tensor, each with its own ``grad1``. The buffer is given too; the plain
    forward of the same module (no ``functional_call``) is the loop's as well."""
    model = seeded(TiedModule).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(2, generator=g, dtype=D).requires_grad_()
    given = {"l1.bias": bias, "buffer": torch.randn(2, generator=g, dtype=D)}
    if not tie_weights:
        given["tied_bias"] = torch.randn(2, generator=g, dtype=D).requires_grad_()
        given["tied_buffer"] = torch.randn(2, generator=g, dtype=D)
    check_functional_call(model, given, x, f"tie_weights={tie_weights}", tie_weights=tie_weights)

    plain = seeded(TiedModule).double()
    want = loop_grad(plain, sq, x)
    with gradhooks.add_hooks(plain, loss_reduction="sum"):
        sq(plain(x)).backward()
    assert_grad1(plain, want, "the module's own forward")


def test_stateless_functional_call_of_some_weights_and_a_bias_given_as_none():
    """pytorch/pytorch ``test/test_stateless.py`` (``test_reparametrize_some_weights``,
    ``test_reparametrize_special``): some weights given (one that requires grad, one that does
    not) and the others the module's own, which keep their ``grad1``; a bias given as ``None``
    is left out of the call (the layer then has no bias, and its own bias no ``grad1``)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    given = perturbed(model, {"2.weight"})
    given["0.weight"] = perturbed(model, {"0.weight"}, seed=6)["0.weight"].detach()
    check_functional_call(model, given, x, "some weights")

    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    check_functional_call(model, {"0.bias": None}, x, "a bias given as None")
    assert not hasattr(model[0].bias, "grad1")


PARAMETRIZED = {
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
    "spectral_norm (eval)": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "symmetric": lambda m: parametrize.register_parametrization(m, "weight", Symmetric()),
}


class Symmetric(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return w.triu() + w.triu(1).T


@pytest.mark.parametrize("kind", list(PARAMETRIZED))
def test_stateless_functional_call_of_a_parametrizations_original(kind):
    """pytorch/pytorch ``test/test_stateless.py``
    (``test_reparametrized_module_change_parametrization_original``): the tensor given for
    ``parametrizations.weight.original`` (``original1`` of weight norm) is what the
    parametrization computes the weight from in that call. Its ``grad1`` is the loop's. Before,
    the hooks refused it (a ``MixedExamplesError`` of the parametrization's recomputation, which
    took the module's own original, not the one the call ran with)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    PARAMETRIZED[kind](model[0])
    model.eval()  # (spectral norm: no power iteration, the loop's forwards see one weight)
    name = "0.parametrizations.weight.original"
    name += "1" if kind == "weight_norm" else ""
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    before = model[0].weight.detach().clone()
    check_functional_call(model, perturbed(model, {name}), x, kind)
    assert torch.equal(model[0].weight, before), "the module's parametrization changed"


def test_stateless_functional_call_of_a_spectral_norm_original_in_training():
    """pytorch/pytorch ``test/test_stateless.py``
    (``test_reparametrize_module_fail_reset_to_original``: spectral norm in training, the
    original given): the power iteration advances ``_u`` and ``_v`` once, as a plain
    ``functional_call`` does, and ``grad1`` of the given original is the loop's, each example
    from a copy of the model as the call found it."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    nn.utils.parametrizations.spectral_norm(model[0])
    name = "0.parametrizations.weight.original"
    given = perturbed(model, {name})
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    rows = []
    for i in range(5):
        one, leaf = copy.deepcopy(model), given[name].detach().requires_grad_()
        loss = sq(functional_call(one, {name: leaf}, (_rows(x, i),)))
        rows.append(torch.autograd.grad(loss, leaf)[0])
    plain = copy.deepcopy(model)
    functional_call(plain, {name: given[name].detach()}, (x,))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(functional_call(model, given, (x,))).backward()
    assert_close(given[name].grad1, torch.stack(rows), "the original given")
    for b in ("_u", "_v"):
        got = getattr(model[0].parametrizations.weight[0], b)
        assert_close(got, getattr(plain[0].parametrizations.weight[0], b), f"{b} advanced once")


def test_stateless_functional_call_of_batch_norm_running_statistics():
    """pytorch/pytorch ``test/test_stateless.py`` (``test_functional_batch_norm``): a
    BatchNorm's ``running_mean`` and ``running_var`` given (in eval, where they normalize each
    example alone) with its weight: ``grad1`` of every parameter is the loop's with those
    statistics, and the module's own statistics are left as they were."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    model = seeded(lambda: model).double().eval()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    g = torch.Generator().manual_seed(3)
    given = perturbed(model, {"1.weight"})
    given["1.running_mean"] = torch.randn(4, generator=g, dtype=D)
    given["1.running_var"] = torch.rand(4, generator=g, dtype=D) + 0.5
    before = (model[1].running_mean.clone(), model[1].running_var.clone())
    check_functional_call(model, given, x, "running statistics given")
    assert torch.equal(model[1].running_mean, before[0])
    assert torch.equal(model[1].running_var, before[1])


class TokenGate(nn.Module):
    """A learned token ``[1, 4]`` through a BatchNorm (eval), gating every example's
    features: a BatchNorm call that does not depend on the examples."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 4))
        self.lin, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x) * self.bn(self.token))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no verify"])
def test_stateless_functional_call_of_running_statistics_of_a_batch_free_call(verify):
    """pytorch/pytorch ``test/test_stateless.py`` (``test_functional_batch_norm``: running
    statistics given) where the BatchNorm normalizes a learned token that every example
    shares: ``grad1`` of its weight is the loop's with the statistics given. Before, the
    engine dropped them on the way to the rule of a call that does not depend on the
    examples, and the rule normalized with the module's own: with ``verify=False`` a wrong
    ``grad1`` of ``bn.weight`` (off by 0.19) and no error; with it, a ``CheckFailedError``."""
    model = seeded(TokenGate).double().eval()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    g = torch.Generator().manual_seed(3)
    given = {
        "bn.running_mean": torch.randn(4, generator=g, dtype=D),
        "bn.running_var": torch.rand(4, generator=g, dtype=D) + 0.5,
    }
    want = functional_loop(model, given, x)
    with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
        sq(functional_call(model, given, (x,))).backward()
    assert_grad1(model, want, "statistics given")


class MaskedLinear(nn.Module):
    """A weight times a mask buffer (a pruning mask), a module without a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))
        self.mask = nn.Buffer(torch.ones(3, 3))

    def forward(self, x: Tensor) -> Tensor:
        return x @ (self.weight * self.mask).T


def test_stateless_functional_call_of_a_buffer_of_a_module_without_a_rule():
    """pytorch/pytorch ``test/test_stateless.py`` (``test_functional_call``, a buffer given with
    the parameters): a mask buffer given to a module gradhooks has no rule for (the fallback
    recomputes its call per example): ``grad1`` is the loop's with that mask, and the next
    plain forward, with the module's own mask, the loop's with it. Before, the recomputation
    took the module's own mask, did not reproduce the call's output, and the backward was
    refused with a ``MixedExamplesError``."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 3), MaskedLinear(), nn.Linear(3, 2)))
    model = model.double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    given = {"1.mask": torch.ones(3, 3, dtype=D).tril()}
    check_functional_call(model, given, x, "a mask given")
    gradhooks.clear_grad1(model)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "the module's own mask")


def test_stateless_functional_call_of_a_parametrizations_buffers():
    """pytorch/pytorch ``test/test_stateless.py`` (buffers given with the parameters), on a
    parametrization's own buffers: spectral norm's ``_u`` and ``_v`` given (eval: no power
    iteration) set the weight's scale in that call; ``grad1`` of every parameter is the
    loop's with them. Before, the parametrization's call, which does not depend on the
    examples, reached the fallback without the buffers it ran with (the engine asked for them
    only where a call keeps its rows, and dropped them where it splits a call's output-gradient
    among the examples): recomputed with the module's own vectors, it was refused with a
    ``MixedExamplesError``."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    nn.utils.parametrizations.spectral_norm(model[0])
    model.eval()
    g = torch.Generator().manual_seed(3)
    given = {
        f"0.parametrizations.weight.0.{b}": F.normalize(torch.randn(4, generator=g, dtype=D), dim=0)
        for b in ("_u", "_v")
    }
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    check_functional_call(model, given, x, "spectral norm's vectors given")


def test_stateless_functional_call_refused_by_strict_leaves_the_hooks_working():
    """pytorch/pytorch ``test/test_stateless.py`` (``test_reparametrize_strict``): a ``strict``
    call missing keys is torch's ``RuntimeError`` under the hooks too, leaving the model as it
    was (parameters, hooks, no ``grad1``); the next forward and backward are the loop's."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        before = model_state(model)
        with pytest.raises(RuntimeError, match=r"Missing key\(s\)"):
            functional_call(model, perturbed(model, {"0.weight"}), (x,), strict=True)
        assert_untouched(model, before)
        sq(model(x)).backward()
    assert_grad1(model, want, "after the refused call")


class First(nn.Module):
    """A layer's first output (self-attention on one input; a bilinear form of the input and
    its features reversed), as the loss's input."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.layer, nn.MultiheadAttention):
            return self.layer(x, x, x, need_weights=False)[0]
        if isinstance(self.layer, nn.Bilinear):
            return self.layer(x, x.flip(-1))
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class Stepped(nn.Module):
    """A recurrent cell stepped over the time steps of ``[batch, time, features]``."""

    def __init__(self, cell: nn.Module):
        super().__init__()
        self.cell = cell

    def forward(self, x: Tensor) -> Tensor:
        state, outs = None, []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1)


def _ints(*shape):
    return lambda: torch.randint(7, shape)


LAYERS = {  # a layer, and a batch of 5 for it
    "Linear": (lambda: nn.Linear(3, 4), lambda: torch.randn(5, 3)),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, padding=1), lambda: torch.randn(5, 2, 5, 5)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), lambda: torch.randn(5, 2, 5)),
    "Embedding": (lambda: nn.Embedding(7, 3), _ints(5, 4)),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(7, 3), _ints(5, 4)),
    "LayerNorm": (lambda: nn.LayerNorm(4), lambda: torch.randn(5, 3, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(5, 4, 3)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), lambda: torch.randn(5, 3, 6)),
    "RMSNorm": (lambda: nn.RMSNorm(4), lambda: torch.randn(5, 3, 4)),
    "PReLU": (lambda: nn.PReLU(3), lambda: torch.randn(5, 3, 4)),
    "LSTM": (lambda: nn.LSTM(3, 4, batch_first=True), lambda: torch.randn(5, 6, 3)),
    "GRU": (lambda: nn.GRU(3, 4, 2, batch_first=True, bidirectional=True),
            lambda: torch.randn(5, 6, 3)),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(4, 2, batch_first=True),
                           lambda: torch.randn(5, 3, 4)),
    "LSTMCell, stepped": (lambda: Stepped(nn.LSTMCell(3, 4)), lambda: torch.randn(5, 4, 3)),
    "Bilinear (no rule)": (lambda: nn.Bilinear(3, 3, 2), lambda: torch.randn(5, 3)),
    "TransformerEncoderLayer": (
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        lambda: torch.randn(5, 3, 4),
    ),
}  # fmt: skip


@pytest.mark.parametrize("layer", list(LAYERS))
def test_functional_call_with_every_parameter_given_per_layer_family(layer):
    """functorch's per-sample-gradient recipe (pytorch/pytorch
    ``test/functorch/test_eager_transforms.py``, ``functional_call`` of the model with its
    parameters given) on every layer family gradhooks has a rule for, and on one it has none
    for (``Bilinear``, by the fallback): the tensors given, other values than the module's,
    have the loop's ``grad1``; the module's own get none."""
    make, inputs = LAYERS[layer]
    model = seeded(lambda: First(make())).double()
    x = seeded(inputs, seed=1)
    x = x.double() if x.is_floating_point() else x
    check_functional_call(model, perturbed(model), x, layer)


class TiedLM(nn.Module):
    """An embedding, an LSTM and an output Linear whose weight is the embedding's table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm = nn.Embedding(7, 4), nn.LSTM(4, 4, batch_first=True)
        self.out = nn.Linear(4, 7)
        self.out.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.out(self.lstm(self.emb(idx))[0])


@pytest.mark.parametrize(
    "given,tie_weights",
    [
        ({"emb.weight"}, True),
        ({"out.weight"}, True),
        ({"emb.weight", "out.weight"}, False),
        ({"lstm.weight_hh_l0"}, True),
    ],
    ids=["table, tied", "head's name, tied", "table and head, untied", "one LSTM weight"],
)
def test_functional_call_of_a_language_model_with_a_tied_head(given, tie_weights):
    """pytorch/pytorch ``test/test_stateless.py`` (``tie_weights``) on a language model whose
    output layer's weight is its embedding's table: the table given once, under either name,
    is used by both (its ``grad1`` sums the rows looked up and the head's outer products);
    untied, each use has its own tensor; one LSTM weight given, the rest of the model's keep
    their ``grad1``."""
    model = seeded(TiedLM).double()
    x = seeded(_ints(5, 6), seed=1)
    check_functional_call(model, perturbed(model, given), x, str(sorted(given)),
                          tie_weights=tie_weights)  # fmt: skip


# == torch: test/nn/test_parametrization.py =====================================================


class Skew(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        upper = w.triu(1)
        return upper - upper.T


class MatrixExp(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return torch.matrix_exp(w)


class Softplus(nn.Module):
    def forward(self, b: Tensor) -> Tensor:
        return F.softplus(b)

    def right_inverse(self, b: Tensor) -> Tensor:
        return b.expm1().log()


def _chained() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    parametrize.register_parametrization(model[0], "weight", Skew())
    parametrize.register_parametrization(model[0], "weight", MatrixExp())
    with torch.no_grad():
        model[2].bias.abs_()
    parametrize.register_parametrization(model[2], "bias", Softplus())
    return model


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cached"])
def test_parametrizations_chained_on_a_weight_and_one_on_a_bias(cached):
    """pytorch/pytorch ``test/nn/test_parametrization.py``
    (``test_register_and_remove_nested_parametrization``, ``test_caching_parametrization``,
    ``test_initialization_parametrization``): an orthogonal weight as ``matrix_exp`` of a skew
    matrix (two parametrizations on one tensor) and a positive bias by ``softplus`` (its
    ``right_inverse`` sets the original): ``grad1`` of both originals is the loop's, also
    with the weight computed once per forward by ``parametrize.cached()``."""
    model = seeded(_chained)
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if cached:
            with parametrize.cached():
                sq(model(x)).backward()
        else:
            sq(model(x)).backward()
    assert_grad1(model, want, "chained")
    w = model[0].weight.detach()
    assert_close(w @ w.T, torch.eye(4, dtype=D), "the weight is orthogonal")


def test_parametrization_transferred_to_another_module_shares_its_original():
    """pytorch/pytorch ``test/nn/test_parametrization.py``
    (``test_transfer_parametrizations_and_params``): a parametrization moved to a second
    Linear by ``transfer_parametrizations_and_params`` keeps one original for both; its
    ``grad1`` sums both layers' uses, each bias its own."""

    def make() -> nn.Module:
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        parametrize.register_parametrization(a, "weight", Skew())
        parametrize.transfer_parametrizations_and_params(a, b)
        return nn.Sequential(a, nn.Tanh(), b).double()

    model = seeded(make)
    first, second = model[0].parametrizations.weight, model[2].parametrizations.weight
    assert first.original is second.original
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "transferred")


class FromVector(nn.Module):
    """A ``[2, 4]`` weight from an ``[8]`` original (``unsafe``: another shape)."""

    def forward(self, v: Tensor) -> Tensor:
        return v.view(2, 4)

    def right_inverse(self, w: Tensor) -> Tensor:
        return w.reshape(-1)


def test_unsafe_parametrization_of_another_shape():
    """pytorch/pytorch ``test/nn/test_parametrization.py`` (``test_unsafe_parametrization``):
    a weight computed from an original of another shape (``unsafe=True``): ``grad1`` of the
    original has the original's shape, ``[batch, 8]``, and is the loop's."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 2))).double()
    parametrize.register_parametrization(model[0], "weight", FromVector(), unsafe=True)
    original = model[0].parametrizations.weight.original
    assert original.shape == (8,)
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert original.grad1.shape == (5, 8)
    assert_grad1(model, want, "unsafe")


def per_example_of_copies(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """The float64 loop, each example through a copy of ``model`` as it is now (in training,
    spectral norm's power iteration then starts from the same vectors for every example)."""
    rows: dict[str, list] = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for i in range(x.shape[0]):
        one = copy.deepcopy(model)
        sq(one(_rows(x, i))).backward()
        for n, p in one.named_parameters():
            if p.requires_grad:
                rows[n].append(p.grad)
    return {n: torch.stack(r) for n, r in rows.items()}


CONV_PARAMETRIZATIONS = {
    "spectral_norm ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(3, 4, (5, 6)),
        nn.utils.parametrizations.spectral_norm,
        (3, 3, 6, 7),
    ),
    "spectral_norm Conv1d": (
        lambda: nn.Conv1d(3, 4, 3, stride=2),
        nn.utils.parametrizations.spectral_norm,
        (3, 3, 9),
    ),
    "weight_norm ConvTranspose1d, dim=1": (
        lambda: nn.ConvTranspose1d(3, 4, 3),
        lambda m: nn.utils.parametrizations.weight_norm(m, dim=1),
        (3, 3, 5),
    ),
}


@pytest.mark.parametrize("case", list(CONV_PARAMETRIZATIONS))
def test_parametrized_convolution_weights_in_training(case):
    """pytorch/pytorch ``test/nn/test_parametrization.py`` (``test_new_spectral_norm_dim``:
    spectral norm of a ``ConvTranspose2d(3, 4, (5, 6))``, whose vectors run along dimension 1;
    ``test_weight_norm_parametrization``): in training, over two steps (the power iteration
    advancing at each forward), ``grad1`` of the originals and the bias is the loop's, each
    example through a copy of the layer as the step found it."""
    make, parametrization, shape = CONV_PARAMETRIZATIONS[case]
    model = seeded(lambda: nn.Sequential(make(), nn.Tanh())).double()
    parametrization(model[0])
    x = seeded(lambda: torch.randn(*shape, dtype=D), seed=1)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(2):
            want = per_example_of_copies(model, x)
            h.clear()
            sq(model(x)).backward()
            assert_grad1(model, want, f"{case}, step {step}")


def test_parametrization_of_a_frozen_weight_gets_no_grad1():
    """pytorch/pytorch ``test/nn/test_parametrization.py``
    (``test_register_parametrization_no_grad``): a parametrization registered on a weight that
    does not require grad makes originals that do not either: they get no ``grad1``, the
    layer's bias and the next layer theirs, the loop's."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    model[0].weight.requires_grad_(False)
    parametrize.register_parametrization(model[0], "weight", Skew())
    assert not model[0].parametrizations.weight.original.requires_grad
    x = seeded(lambda: torch.randn(5, 4, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "frozen parametrized weight", frozen_clean=True)


# == torch: test/test_expanded_weights.py, test_group_norm_error ================================


class GroupNormOf(nn.Module):
    """``F.group_norm`` on the module's own weight and bias."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight, self.bias = (
            nn.Parameter(torch.ones(channels)),
            nn.Parameter(torch.zeros(channels)),
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.group_norm(x, self.groups, self.weight, self.bias)


@pytest.mark.parametrize("channels", [5, 6], ids=["5 channels: refused by torch", "6 channels"])
def test_expanded_weights_group_norm_over_channels_its_groups_do_not_divide(channels):
    """pytorch/pytorch ``test/test_expanded_weights.py`` (``test_group_norm_error``): with 5
    channels in 2 groups, ``F.group_norm`` raises torch's own error under the hooks as without
    them, nothing written; with 6, ``grad1`` is the loop's."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, channels), GroupNormOf(channels, 2)))
    model = model.double()
    x = seeded(lambda: torch.randn(3, 4, dtype=D), seed=1)
    if channels == 5:
        before = model_state(model)
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            with pytest.raises(RuntimeError, match="divisible by num_groups"):
                sq(model(x)).backward()
        assert_untouched(model, before)
        return
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "group_norm")


# == Opacus: validators (lstm_test.py, gru_test.py), dp_layers/dp_rnn_test.py ===================


class RecurrentNet(nn.Module):
    """A recurrent layer (its first output) and a Linear on every step."""

    def __init__(self, kind: type, batch_first: bool, **kw):
        super().__init__()
        self.rnn = kind(3, 4, batch_first=batch_first, **kw)
        self.fc = nn.Linear(4 * (2 if kw.get("bidirectional") else 1), 2)

    def forward(self, x: Tensor, h0=None) -> Tensor:
        return self.fc(self.rnn(x, h0)[0])


class BatchFirst(nn.Module):
    """The examples on dimension 0 for the loop, whatever the layer's order."""

    def __init__(self, inner: nn.Module, batch_first: bool):
        super().__init__()
        self.inner, self.batch_first = inner, batch_first

    def forward(self, x: Tensor, h0=None) -> Tensor:
        if h0 is not None:
            h0 = (
                tuple(h.transpose(0, 1) for h in h0)
                if isinstance(h0, tuple)
                else h0.transpose(0, 1)
            )
        x = x if self.batch_first else x.transpose(0, 1)
        out = self.inner(x) if h0 is None else self.inner(x, h0)
        return out if self.batch_first else out.transpose(0, 1)


RNN_SETTINGS = [  # the layer, batch-first, its options, an initial state
    (nn.LSTM, True, {}, False),
    (nn.LSTM, False, dict(num_layers=2, bidirectional=True), True),
    (nn.GRU, True, dict(num_layers=2, bidirectional=True), True),
    (nn.GRU, False, {}, False),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "kind,batch_first,kw,initial", RNN_SETTINGS,
    ids=[f"{k.__name__}-{'batch-first' if bf else 'time-major'}-{kw or 'one layer'}"
         f"-{'initial state' if h else 'zero state'}" for k, bf, kw, h in RNN_SETTINGS],
)  # fmt: skip
def test_opacus_fixed_recurrent_layer_is_the_torch_layers_per_example(
    kind, batch_first, kw, initial
):
    """Opacus ``opacus/tests/validators/lstm_test.py`` / ``gru_test.py`` (``test_fix``: the
    validator replaces ``nn.LSTM`` / ``nn.GRU`` by ``DPLSTM`` / ``DPGRU``) and
    ``opacus/tests/dp_layers/dp_rnn_test.py`` (the DP layer with the torch layer's
    ``state_dict`` gives its outputs and gradients): Opacus' own layers, whose cells are
    ``RNNLinear`` modules called at every time step, hooked as they are. ``grad1`` of every
    parameter is the per-example loop's and the torch layer's ``grad1`` under the same names
    (Opacus' layers name their parameters as torch's do), with or without an initial state,
    over two layers and directions; time-major with ``batch_dim=1``."""
    validators = pytest.importorskip("opacus.validators", reason="needs opacus")
    torch_model = seeded(lambda: RecurrentNet(kind, batch_first, **kw)).double()
    fixed = validators.ModuleValidator.fix(copy.deepcopy(torch_model)).double()
    assert type(fixed.rnn).__module__.startswith("opacus"), type(fixed.rnn)
    fixed.rnn.load_state_dict(torch_model.rnn.state_dict())
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    x = seeded(lambda: torch.randn(5, 6, 3, dtype=D), seed=1)  # [batch, time, features]
    g = torch.Generator().manual_seed(2)
    states = 2 if kind is nn.LSTM else 1
    h0 = [torch.randn(5, layers, 4, generator=g, dtype=D) for _ in range(states)] if initial else []
    h0b = (tuple(h0) if kind is nn.LSTM else h0[0]) if initial else None

    def as_called(t):  # the layer's own order
        return t if batch_first else t.transpose(0, 1)

    args = (as_called(x), *([_layer_state(h0, kind)] if initial else []))
    for model in (torch_model, fixed):
        inputs = (x, *([h0b] if initial else []))
        want = loop_grad(BatchFirst(model, batch_first), sq, inputs)
        want = {n.removeprefix("inner."): w for n, w in want.items()}
        with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=0 if batch_first else 1):
            sq(model(*args)).backward()
        assert_grad1(model, want, type(model.rnn).__name__)
    for n, p in torch_model.named_parameters():
        assert_close(dict(fixed.named_parameters())[n].grad1, p.grad1, f"DP layer vs torch's: {n}")


def _layer_state(h0: list[Tensor], kind: type):
    """An initial state as the layer takes it: ``[layers·directions, batch, hidden]``."""
    hs = tuple(h.transpose(0, 1).contiguous() for h in h0)
    return hs if kind is nn.LSTM else hs[0]


class SelfAttention(nn.Module):
    """Self-attention on a time-major ``[time, batch, embed]`` input, its output alone."""

    def __init__(self, **kw):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 4, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.att(x, x, x)[0]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "kw",
    [{}, dict(add_bias_kv=True), dict(add_zero_attn=True)],
    ids=["plain", "bias_kv", "zero_attn"],
)
def test_opacus_fixed_attention_is_the_torch_attentions_per_example(kw):
    """Opacus ``opacus/tests/validators/multihead_attention_test.py`` (``test_fix``: the
    validator replaces ``nn.MultiheadAttention(8, 4)`` by its ``DPMultiheadAttention`` with the
    same state): both time-major (``batch_dim=1``), their outputs equal, each one's ``grad1``
    the loop's, and the DP layer's q / k / v Linears' ``grad1`` stacked is the torch layer's
    ``in_proj_weight``'s (its ``out_proj`` and the appended key and value biases alike)."""
    validators = pytest.importorskip("opacus.validators", reason="needs opacus")
    torch_model = seeded(lambda: SelfAttention(**kw)).double()
    fixed = validators.ModuleValidator.fix(copy.deepcopy(torch_model)).double()
    assert type(fixed.att).__name__ == "DPMultiheadAttention"
    x = seeded(lambda: torch.randn(5, 3, 8, dtype=D), seed=1)  # [batch, time, embed]
    assert_close(fixed(x.transpose(0, 1)), torch_model(x.transpose(0, 1)), "the outputs")
    for model in (torch_model, fixed):
        want = loop_grad(BatchFirst(model, False), lambda out: sq(out), x)
        want = {n.removeprefix("inner."): w for n, w in want.items()}
        with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=1):
            sq(model(x.transpose(0, 1))).backward()
        assert_grad1(model, want, type(model.att).__name__)
    dp, torch_att = fixed.att, torch_model.att
    stacked = torch.cat(
        [dp.qlinear.weight.grad1, dp.klinear.weight.grad1, dp.vlinear.weight.grad1], 1
    )
    assert_close(stacked, torch_att.in_proj_weight.grad1, "q, k, v weights vs in_proj_weight")
    stacked = torch.cat([dp.qlinear.bias.grad1, dp.klinear.bias.grad1, dp.vlinear.bias.grad1], 1)
    assert_close(stacked, torch_att.in_proj_bias.grad1, "q, k, v biases vs in_proj_bias")
    assert_close(dp.out_proj.weight.grad1, torch_att.out_proj.weight.grad1, "out_proj")
    if kw.get("add_bias_kv"):
        assert_close(dp.seq_bias_k.bias.grad1, torch_att.bias_k.grad1.flatten(1), "bias_k")
        assert_close(dp.seq_bias_v.bias.grad1, torch_att.bias_v.grad1.flatten(1), "bias_v")


def test_opacus_time_major_dp_lstm_with_the_default_batch_dim_is_refused():
    """Opacus' ``DPLSTM`` time-major (``batch_first=False``, ``[time, batch, features]``),
    hooked with the default ``batch_dim``: its cells are called on one time step at a time,
    ``x[t]``, which with dimension 0 taken as the batch is one example taken out of it. Refused
    at the forward, naming the cell and ``batch_dim`` (with ``batch_dim=1`` it is the loop's:
    the test above)."""
    layers = pytest.importorskip("opacus.layers", reason="needs opacus")
    rnn = seeded(lambda: layers.DPLSTM(3, 4, batch_first=False)).double()
    x = seeded(lambda: torch.randn(6, 5, 3, dtype=D), seed=1)
    before = model_state(rnn)
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'l0\.ih' \(RNNLinear\).*batch_dim"
        ):
            rnn(x)
    assert_untouched(rnn, before)


# == jax-privacy: experimental/clipping_test.py, microbatching_test.py ===========================

C = 0.5  # the clipping bound
METHODS = {"grad1": ("grad1",), "bookkeeping": ("norms",), "ghost": ("norms",)}


def classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def clipped(model, x, y, method: str, weight: Tensor | None = None) -> Tensor:
    """The clipped sum of ``gradhooks.clipped_sum`` over the batch, flattened, every
    parameter's in turn; each example's loss times ``weight`` (0 for a padding example)."""
    with gradhooks.add_hooks(model, quantities=METHODS[method]) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        if weight is not None:
            losses = losses * weight
        got = gradhooks.clipped_sum(h, losses, max_norm=C, method=method)
    gradhooks.clear_grad1(model)
    for p in model.parameters():
        p.grad = None
    return torch.cat([s.flatten() for s in got.sums])


def clipped_by_loop(model, x, y) -> Tensor:
    """``Σ_i min(1, C/‖g_i‖) · g_i`` of the per-example loop's gradients, flattened."""
    want = loop_grad(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    return ((C / flat.norm(dim=1)).clamp(max=1.0)[:, None] * flat).sum(0)


def labelled(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(3, (n,), generator=g)


@pytest.mark.parametrize("method", list(METHODS))
def test_jax_privacy_clipped_sum_sensitivity_to_one_example(method):
    """google-deepmind/jax_privacy ``jax_privacy/experimental/clipping_test.py``
    (``test_clip_sum_sensitivity``): the clipped sum of 15 examples is the loop's; replacing
    example 3 by an outlier moves it by at most ``2C`` (replace-one), removing it by at most
    ``C`` (add-or-remove), and turning it into padding (its loss weighted by 0) gives the sum
    without it."""
    model = seeded(classifier)
    x, y = labelled(15)
    base = clipped(model, x, y, method)
    assert_close(base, clipped_by_loop(model, x, y), "the clipped sum")
    outlier = x.clone()
    outlier[3] = torch.tensor([-10.0, 10.0, 20.0, 20.0], dtype=D)
    replaced = clipped(model, outlier, y, method)
    assert (replaced - base).norm() <= 2 * C * (1 + 1e-9), "replace-one"
    assert (replaced - base).norm() > C / 10, "the outlier moved the sum (else the bound is idle)"
    keep = torch.arange(15) != 3
    removed = clipped(model, x[keep], y[keep], method)
    assert (removed - base).norm() <= C * (1 + 1e-9), "add-or-remove"
    padded = clipped(model, x, y, method, weight=keep.to(D))
    assert_close(padded, removed, "a padding example")


@pytest.mark.parametrize("size", [1, 2, 5, 10])
def test_jax_privacy_clipped_sum_by_micro_batches_with_padding(size):
    """google-deepmind/jax_privacy ``jax_privacy/experimental/microbatching_test.py``
    (``test_microbatched_fn_general``, ``test_dynamic_batch_size``): a batch of 10 whose last
    three examples are padding, taken in micro-batches of ``size`` (some of them padding
    alone): the sum of their clipped sums is the whole batch's, and that is the loop's over the
    seven real examples."""
    model = seeded(classifier)
    x, y = labelled(10, seed=2)
    real = torch.arange(10) < 7
    parts = [
        clipped(model, x[i : i + size], y[i : i + size], "grad1", real[i : i + size].to(D))
        for i in range(0, 10, size)
    ]
    whole = clipped(model, x, y, "grad1", real.to(D))
    assert_close(torch.stack(parts).sum(0), whole, f"micro-batches of {size}")
    assert_close(whole, clipped_by_loop(model, x[real], y[real]), "the real examples' sum")


# == Opacus: tests/multigpu_gradcheck_test.py, its single-process step ==========================


class ToyModel(nn.Module):
    """Opacus' ``ToyModel``: Linear(10, 10), ReLU, Linear(10, 5); its first weight zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 10), nn.Linear(10, 5)
        with torch.no_grad():
            self.net1.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.net2(F.relu(self.net1(x)))


GRADCHECK = {  # how Opacus clips: the DP step's method and clipping groups
    "flat": ("grad1", None),
    "per_layer": ("grad1", "parameter"),
    "ghost": ("ghost", None),
    "bookkeeping": ("bookkeeping", None),
}


@pytest.mark.parametrize("clipping", list(GRADCHECK))
def test_opacus_gradcheck_step_without_clipping_or_noise_is_plain_sgd(clipping):
    """Opacus ``opacus/tests/multigpu_gradcheck_test.py`` (``demo_basic``,
    ``run_ghost_clipping_test``, one process): soft labels drawn from ``randn`` (not
    probabilities) under ``CrossEntropyLoss``, the first weight zeroed, a bound of ``1e8`` and
    no noise: one DP step by each clipping (flat, per layer, ghost; and book-keeping) and SGD
    with ``lr=1`` leaves the weights where plain training does; the per-example gradients of
    those soft-label losses are the loop's."""
    method, groups = GRADCHECK[clipping]
    model = seeded(ToyModel).double()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 10, generator=g, dtype=D), torch.randn(4, 5, generator=g, dtype=D)
    opt = torch.optim.SGD(plain.parameters(), lr=1.0)
    F.cross_entropy(plain(x), y).backward()
    opt.step()

    quantities = ("grad1",) if method == "grad1" else ("norms",)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    want = loop_grad(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=1e8, noise_multiplier=0.0, method=method,
                              clipping_groups=groups)  # fmt: skip
    if method == "grad1":
        assert_grad1(model, want, "soft labels")
    opt.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert_close(p.detach(), q.detach(), f"{clipping}: {n} after the step")


# == pytorch-sso: tests/test_batched_grads.py, tests/test_samplegrad.py =========================


class UpDown(nn.Module):
    """pytorch-sso's ``ConvNet1D/2D/3D``: a strided convolution down, a transposed one up to
    the input's size (``output_size=x.size()``, which sets the output padding), returning
    the reconstruction error."""

    def __init__(self, dims: int):
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        up = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[dims - 1]
        self.downsample = conv(3, 5, 3, stride=2, padding=1)
        self.upsample = up(5, 3, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.upsample(self.downsample(x), output_size=x.size()) - x


@pytest.mark.parametrize("dims,size", [(1, 12), (1, 11), (2, 11), (3, 7)])
def test_pytorch_sso_transposed_convolution_to_the_inputs_size(dims, size):
    """cybertronai/pytorch-sso ``tests/test_batched_grads.py`` (``ConvNet1D/2D/3D``,
    ``get_loss``: half the squared reconstruction error over the batch size): the transposed
    convolution given ``output_size`` (an odd size needs no output padding, an even one
    does) has the loop's ``grad1`` under the mean loss, and ``grad1.mean(0)`` is ``.grad``."""
    model = seeded(lambda: UpDown(dims)).double()
    x = seeded(lambda: torch.randn(4, 3, *[size] * dims, dtype=D), seed=1)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model):
        (sq(model(x)) / 4).backward()
    assert_grad1(model, want, f"{dims}-d, size {size}")
    for n, p in model.named_parameters():
        assert_close(p.grad1.mean(0), p.grad, f"grad1.mean(0) vs .grad: {n}")


class LeNet5BatchNorm(nn.Module):
    """pytorch-sso's ``LeNet5BatchNorm``: two convolutions and three Linears, each but the last
    followed by a BatchNorm, on ``[3, 32, 32]`` images."""

    def __init__(self, affine: bool = True):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 5), nn.BatchNorm2d(6, affine=affine)
        self.conv2, self.bn2 = nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16, affine=affine)
        self.fc1, self.bn3 = nn.Linear(400, 120), nn.BatchNorm1d(120, affine=affine)
        self.fc2, self.bn4 = nn.Linear(120, 84), nn.BatchNorm1d(84, affine=affine)
        self.fc3 = nn.Linear(84, 10, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        h = F.relu(self.bn3(self.fc1(h.flatten(1))))
        return self.fc3(F.relu(self.bn4(self.fc2(h))))


def test_pytorch_sso_lenet_with_batch_norm():
    """cybertronai/pytorch-sso ``tests/test_samplegrad.py`` / ``test_batched_grads.py``
    (``LeNet5BatchNorm``, ``out.sum()`` and a squared error to random targets): in training,
    the BatchNorms normalize over the batch, which mixes the examples: refused, naming the
    first BatchNorm (or, without affine parameters, it is not hooked, the ``batch_norm`` that
    the next layer's input came from), nothing written; in eval (running statistics),
    ``grad1`` of every parameter, the BatchNorms' scale and shift included, is the loop's."""
    x = seeded(lambda: torch.randn(2, 3, 32, 32, dtype=D), seed=1)
    for affine, says in ((False, r"'conv2'.*batch_norm"), (True, r"'bn1' \(BatchNorm2d\)")):
        model = seeded(lambda affine=affine: LeNet5BatchNorm(affine)).double()
        before = model_state(model)
        with pytest.raises(gradhooks.MixedExamplesError, match=says):
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                model(x).sum().backward()
        assert_untouched(model, before)
    model.eval()
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "eval")

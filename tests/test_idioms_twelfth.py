"""Training-loop idioms, a twelfth set: how people train on GPUs and in modern loops, on the CPU.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), an idiom the earlier sets do not run: bfloat16 autocast entered as a decorator on
``forward``, switched on by ``torch.set_autocast_enabled`` / ``set_autocast_dtype`` by hand, or
without its weight cache (``cache_enabled=False``); one submodule cast to bfloat16 while the rest
stays in float32; the norms and squared sums under a float16 ``GradScaler`` that grows,
overflows and shrinks; ``torch.func.functional_call`` with a batch norm's running statistics
replaced at every step (``strict=True``; also under ``save_on_cpu``), with other tensors in
place of the parameters of layers whose rules recompute the call (a Transformer layer, an LSTM,
a GRU, a GRU cell, a cross-attention), and with ``tie_weights=False`` splitting a tied weight;
a forward whose output is never backpropagated before the step's own, and an evaluation
forward between two micro-batches of an accumulation (with grad, under ``no_grad``, under
``inference_mode``); a parametrization cached for the forward (``parametrize.cached()``);
micro-batches of unequal sizes read and cleared one by one; a ``DistributedDataParallel``
model in one process accumulating under ``no_sync()``; an input that requires grad (a
universal adversarial perturbation updated from its ``.grad``); batches of one example
through the norms and the DP step. And misuse: ``backward()`` twice without ``retain_graph``,
hooks removed in the middle of an accumulation and added again.
Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), within bfloat16's or float16's rounding where the model
ran in it, or checked to stop with an error that says what went wrong and leaves the model as
it was."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1

D = torch.float64
STEPS = 3


def batch(step: int, n: int = 5, dtype: torch.dtype = D, features: int = 3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, features, generator=g, dtype=dtype)
    return x, torch.randint(2, (n,), generator=g)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in want.values()))


def assert_within(model: nn.Module, want: dict, rel: float, what: str) -> None:
    """Every trainable parameter's ``grad1``, in its own dtype, within ``rel`` of the largest
    entry of the float64 loop's (bfloat16's 8 bits: ``5e-2``, as docs/mixed-precision.md
    allows)."""
    for n, p in model.named_parameters():
        got, ref = p.grad1.to(D), want[n]
        assert got.shape == ref.shape, f"{what} {n}: {tuple(got.shape)} != {tuple(ref.shape)}"
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < rel, f"{what} {n}: {err:.2e} of the largest entry"


# -- bfloat16 autocast entered otherwise, and a model of mixed dtypes --------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _DecoratedNet(_Net):
    """``torch.autocast`` as a decorator on ``forward``, as its docstring shows
    (pytorch/pytorch, ``torch/amp/autocast_mode.py``)."""

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return super().forward(x)


@contextlib.contextmanager
def _autocast_by_hand():
    """Autocast switched on and off with ``torch.set_autocast_enabled`` and
    ``torch.set_autocast_dtype`` (what ``torch.autocast.__enter__`` does, written out by a loop
    that keeps one switch for the whole run), its cache cleared on the way out."""
    enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cpu", enabled)
        torch.set_autocast_dtype("cpu", dtype)
        torch.clear_autocast_cache()


_AUTOCAST = {
    "decorator": contextlib.nullcontext,
    "set_autocast": _autocast_by_hand,
    "uncached": lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
}


@pytest.mark.parametrize("how", sorted(_AUTOCAST))
def test_bfloat16_autocast_as_a_decorator_set_by_hand_or_without_its_cache(how):
    """bfloat16 autocast entered three ways the earlier sets do not: as a decorator on
    ``forward``, by ``torch.set_autocast_enabled`` / ``set_autocast_dtype``, and as a context
    without its weight cache (``cache_enabled=False``: every Linear casts its weight afresh).
    The output is bfloat16; ``grad1`` (float32, the parameters' dtype) and the norms are
    within bfloat16's rounding of the float64 loop of the same model without autocast, at
    every step of SGD."""
    torch.manual_seed(0)
    model = _DecoratedNet() if how == "decorator" else _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = batch(step, dtype=torch.float32)
            reference = _Net().to(D)
            reference.load_state_dict(model.state_dict())
            want = loop_grad(reference, F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with _AUTOCAST[how]():
                out = model(x)
            assert out.dtype == torch.bfloat16
            F.cross_entropy(out.float(), y).backward()
            assert model.a.weight.grad1.dtype == torch.float32
            assert_within(model, want, 5e-2, f"{how}, step {step}")
            torch.testing.assert_close(hooks.norms().to(D), norms_of(want), rtol=5e-2, atol=0)
            opt.step()
    assert not torch.is_autocast_enabled("cpu")


class _HalfHead(nn.Module):
    """A float32 trunk and a head cast to bfloat16 on its own (``model.head.to(bfloat16)``),
    its input cast to the head's dtype in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.LayerNorm(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.trunk(x.to(self.trunk[0].weight.dtype))
        return self.head(h.to(self.head.weight.dtype)).float()


def test_one_submodule_cast_to_bfloat16_the_rest_in_float32():
    """Parameters of two dtypes in one model, no autocast: each ``grad1`` has its
    parameter's dtype (the head's bfloat16, the trunk's float32); every one is within
    bfloat16's rounding of the float64 loop (the trunk's output-gradients come back through the
    bfloat16 head), the trunk's reduces to its float32 ``.grad`` within float32's rounding, and
    the norms follow the loop, over AdamW steps."""
    model = _HalfHead()
    model.head.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = batch(step, dtype=torch.float32)
            want = loop_grad(copy.deepcopy(model).to(D), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == p.dtype, n
            for n, p in model.trunk.named_parameters(prefix="trunk"):
                torch.testing.assert_close(p.grad1.mean(0), p.grad, msg=n)
            assert_within(model, want, 5e-2, f"step {step}")
            torch.testing.assert_close(hooks.norms().to(D), norms_of(want), rtol=5e-2, atol=0)
            opt.step()


# -- functional_call with a batch norm's running statistics replaced ---------------------------


class _NormedNet(nn.Module):
    """A Linear at each of 4 positions, a batch or instance norm over its 6 channels in eval
    mode (its running statistics), a mean over the positions, a Linear."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)
        self.norm = norm(6, affine=True, track_running_stats=True)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x).transpose(1, 2))).mean(-1))


def _statistics(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "norm.running_mean": torch.randn(6, generator=g, dtype=D),
        "norm.running_var": torch.rand(6, generator=g, dtype=D) + 0.5,
        "norm.num_batches_tracked": torch.tensor(step),
    }


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "save_on_cpu"])
@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.InstanceNorm1d], ids=["batch", "instance"])
def test_functional_call_with_the_norms_running_statistics_replaced_at_each_step(norm, offload):
    """``functional_call(model, (params, buffers), (x,), strict=True)`` with other running
    statistics at every step (statistics of another domain, a model soup's): the batch or
    instance norm, in eval mode, normalizes with the statistics it was handed. Before, its
    rule read the module's own at the backward: the norm's grad1 came from statistics the
    forward never used (the guard caught it where it ran, a CheckFailedError blaming "a use
    of the parameter the hooks did not see"; without it, silently wrong), and likewise under
    saved-tensor hooks (``torch.autograd.graph.save_on_cpu``). grad1 is the float64 loop's of
    the model loaded with those statistics, and the module's own are untouched."""
    model = _NormedNet(norm).to(D).eval()
    own = {n: b.clone() for n, b in model.named_buffers()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offloaded = torch.autograd.graph.save_on_cpu if offload else contextlib.nullcontext
    with gradhooks.add_hooks(model) as hooks:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 4, 3, generator=g, dtype=D), torch.randint(2, (5,), generator=g)
            stats = _statistics(step)
            params = dict(model.named_parameters())
            reference = copy.deepcopy(model)
            reference.load_state_dict({**params, **stats}, strict=True)
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            with offloaded():
                out = torch.func.functional_call(model, (params, stats), (x,), strict=True)
                F.cross_entropy(out, y).backward()
            assert_grad1(model, want, f"step {step}")
            hooks.check()
            opt.step()
    for n, b in model.named_buffers():
        assert torch.equal(b, own[n]), n


def _perturbed(model: nn.Module, step: int) -> dict:
    """Other leaf tensors in place of each of ``model``'s parameters (an ensemble member's,
    fast weights of a first-order meta-learner), which get the ``grad1``."""
    g = torch.Generator().manual_seed(200 + step)
    return {
        n: (p.detach() + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)).requires_grad_()
        for n, p in model.named_parameters()
    }


class _Recomputed(nn.Module):
    """A Linear at each of 5 positions, then a layer whose rule reads its parameters' values
    at the backward (it recomputes the call: a Transformer layer's parts, an LSTM's or GRU's
    recurrence, a GRU cell's gates, a cross-attention), a mean over the positions, a Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.a, self.b = kind, nn.Linear(3, 8), nn.Linear(8, 2)
        self.layer = {
            "transformer": lambda: nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True),
            "lstm": lambda: nn.LSTM(8, 8, batch_first=True),
            "gru": lambda: nn.GRU(8, 8, batch_first=True),
            "gru_cell": lambda: nn.GRUCell(8, 8),
            "cross_attention": lambda: nn.MultiheadAttention(8, 2, batch_first=True),
        }[kind]()

    def forward(self, x):
        h = self.a(x)
        if self.kind == "transformer":
            h = self.layer(h)
        elif self.kind in ("lstm", "gru"):
            h = self.layer(h)[0]
        elif self.kind == "gru_cell":
            h = self.layer(h[:, 1], torch.tanh(h[:, 0]))[:, None]
        else:
            h = self.layer(h, h.flip(1), h.flip(1), need_weights=False)[0]
        return self.b(h.mean(1))


@pytest.mark.parametrize("kind", ["transformer", "lstm", "gru", "gru_cell", "cross_attention"])
def test_functional_call_with_other_tensors_through_a_layer_that_recomputes(kind):
    """``functional_call(model, other, (x,))`` with leaf tensors in place of every parameter
    (an ensemble member's, first-order fast weights), through a layer whose rule recomputes
    the call: each tensor's grad1 is the float64 loop's of the model loaded with them, and its
    ``.grad`` is what autograd gives without hooks. Before, those rules read the module's own
    parameters at the backward (functional_call has put them back by then): the guard refused
    the step (a CheckFailedError), and for the LSTM, whose rule also gives autograd the
    gradients of the call (it runs without autograd), ``.grad`` itself was wrong, the input
    Linear's too, with no error."""
    model = _Recomputed(kind).to(D)
    twin = copy.deepcopy(model)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 5, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            other = _perturbed(model, step)
            plain = {n: t.detach().clone().requires_grad_() for n, t in other.items()}
            reference = copy.deepcopy(model)
            reference.load_state_dict({n: t.detach() for n, t in other.items()})
            want = loop_grad(reference, F.cross_entropy, x, y)
            F.cross_entropy(torch.func.functional_call(model, other, (x,)), y).backward()
            F.cross_entropy(torch.func.functional_call(twin, plain, (x,)), y).backward()
            for n, t in other.items():
                torch.testing.assert_close(t.grad1, want[n], msg=n)
                torch.testing.assert_close(t.grad, plain[n].grad, msg=n)
            hooks.clear()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is None and not hasattr(p, "grad1") and torch.equal(p, q), n


_FROZEN = {
    "transformer": "layer.linear1.weight",
    "lstm": "layer.weight_hh_l0",
    "gru_cell": "layer.weight_hh",
}


@pytest.mark.parametrize("kind", sorted(_FROZEN))
def test_functional_call_replacing_only_a_frozen_weight_of_a_layer_that_recomputes(kind):
    """A frozen weight of the layer (a pretrained part kept fixed) replaced alone,
    ``functional_call(model, {name: w}, (x,))``, the trainable parameters the model's own:
    grad1 of every trainable parameter is the float64 loop's of the model loaded with ``w``,
    and ``.grad`` is what autograd gives without hooks. Before, the engine did not plan the
    hooks again for a frozen tensor replaced (it does for a trainable one), so the rules read
    the module's own frozen weight: for the LSTM, whose rule gives autograd the gradients of
    the call, ``.grad`` was wrong (the input Linear's off by about 1e-3) with no error; the
    others' steps were refused by the guard."""
    model = _Recomputed(kind).to(D)
    frozen = _FROZEN[kind]
    model.get_parameter(frozen).requires_grad_(False)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    twin_opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 5, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            w = model.get_parameter(frozen).detach() + 0.3 * torch.randn(
                model.get_parameter(frozen).shape, generator=g, dtype=D
            )
            reference = copy.deepcopy(model)
            reference.get_parameter(frozen).data.copy_(w)
            want = loop_grad(reference, F.cross_entropy, x, y)
            for m, o in ((model, opt), (twin, twin_opt)):
                o.zero_grad()
                out = torch.func.functional_call(m, {frozen: w}, (x,))
                F.cross_entropy(out, y).backward()
            assert_grad1(model, want, f"step {step}")
            for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, q.grad, msg=n)
            opt.step()
            twin_opt.step()


class _Tied(nn.Module):
    """A language model's head tied to its embedding (``head.weight = emb.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)).mean(1))


def test_functional_call_with_tie_weights_false_replaces_one_use_of_a_tied_weight():
    """``functional_call(model, {"emb.weight": w}, (t,), tie_weights=False)``: the embedding
    looks its rows up in ``w`` while the head keeps the model's own (tied) weight. Each gets
    the grad1 of its own use: ``w`` the embedding's, the model's weight the head's, each the
    float64 loop's of the untied model; the next step after ``zero_grad`` starts afresh."""
    model = _Tied().to(D)
    untied = nn.ModuleDict({"emb": nn.Embedding(7, 4), "head": nn.Linear(4, 7, bias=False)})
    untied = untied.to(D)
    untied.forward = lambda tokens: untied.head(torch.tanh(untied.emb(tokens)).mean(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            tokens, y = torch.randint(7, (4, 3), generator=g), torch.randint(7, (4,), generator=g)
            w = (model.emb.weight.detach() + 0.1).requires_grad_()
            with torch.no_grad():
                untied.emb.weight.copy_(w)
                untied.head.weight.copy_(model.head.weight)
            want = loop_grad(untied, F.cross_entropy, tokens, y)
            opt.zero_grad()
            out = torch.func.functional_call(model, {"emb.weight": w}, (tokens,), tie_weights=False)
            F.cross_entropy(out, y).backward()
            torch.testing.assert_close(w.grad1, want["emb.weight"])
            torch.testing.assert_close(model.emb.weight.grad1, want["head.weight"])
            opt.step()


# -- the loop's habits --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [7, 5], ids=["other_size", "same_size"])
def test_a_forward_never_backpropagated_before_the_steps_own(size):
    """An evaluation forward written without ``torch.no_grad()`` (its output kept for logging
    while the step runs), of a batch of another size or of the same size, then the step's own
    forward and backward: grad1 and the norms are the step's examples' alone (the float64
    loop's), and the graph the first forward left is never backpropagated."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            logged = model(batch(100 + step, n=size)[0])  # requires grad; never backpropagated
            F.cross_entropy(model(x), y).backward()
            assert logged.requires_grad
            assert_grad1(model, want, f"step {step}")
            torch.testing.assert_close(hooks.norms(), norms_of(want))
            opt.step()


def test_backward_twice_without_retain_graph_is_torchs_error_and_leaves_grad1():
    """``loss.backward()`` a second time on a graph whose first backward freed it: autograd
    refuses it (its RuntimeError, raised at the loss's own node, before any hooked layer), and
    ``grad1`` and ``.grad`` stay as the first backward left them, the float64 loop's; the next
    steps run as usual."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
            assert_grad1(model, want, f"step {step}")
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, grads[n]), n
            opt.step()


@pytest.mark.parametrize("quantities", [("grad1", "norms"), ("norms",)], ids=["grad1", "norms"])
def test_micro_batches_of_unequal_sizes_read_one_by_one(quantities):
    """A logical batch of 10 split into micro-batches of 4, 4 and 2 (the last one partial),
    each loss summed and divided by the logical batch's size, ``loss_reduction="sum"``:
    ``grad1`` and the norms are read after each micro-batch's backward. With ``grad1``,
    ``hooks.clear()`` then starts it afresh (``.grad`` goes on adding), so the sizes may
    differ; a handle of norms alone needs no ``clear()`` (they are each backward's own). The
    rows put together are the float64 loop's over the whole batch (divided by 10), and their
    sum is ``.grad``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, n=10)
    with gradhooks.add_hooks(model, quantities=quantities, loss_reduction="sum") as hooks:
        for step in range(STEPS):
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            rows, norms = {n: [] for n in want}, []
            for xb, yb in zip(x.split(4), y.split(4)):
                (F.cross_entropy(model(xb), yb, reduction="sum") / len(x)).backward()
                norms.append(hooks.norms())
                if "grad1" in quantities:
                    for n, p in model.named_parameters():
                        rows[n].append(p.grad1)
                    hooks.clear()
            torch.testing.assert_close(torch.cat(norms), norms_of(want) / len(x))
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n].sum(0) / len(x), msg=n)
                if "grad1" in quantities:
                    torch.testing.assert_close(torch.cat(rows[n]), want[n] / len(x), msg=n)
            opt.step()
            x, y = batch(step + 1, n=10)


_EVALUATION = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("mode", sorted(_EVALUATION))
def test_an_evaluation_forward_between_two_micro_batches_of_an_accumulation(mode):
    """An evaluation in the middle of a step's accumulation (a validation loss logged every
    so many micro-batches): ``model.eval()``, a forward of a batch of another size (with grad
    on and never backpropagated, under ``no_grad`` or under ``inference_mode``),
    ``model.train()``, then the step's last micro-batch. grad1 is the three micro-batches'
    sum, the mean of the float64 loop's of each, with no refusal of the evaluation batch's
    other size; the norms are the last micro-batch's own."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(2):
            micro = [batch(10 * step + k) for k in range(3)]
            each = [loop_grad(model, F.cross_entropy, xb, yb) for xb, yb in micro]
            opt.zero_grad()
            for k, (xb, yb) in enumerate(micro):
                (F.cross_entropy(model(xb), yb) / 3).backward()
                if k == 1:
                    model.eval()
                    with _EVALUATION[mode]():
                        logged = model(batch(100 + step, n=7)[0])
                    model.train()
            assert logged.requires_grad == (mode == "grad")
            assert_grad1(model, {n: sum(w[n] for w in each) / 3 for n in each[0]}, f"step {step}")
            torch.testing.assert_close(hooks.norms(), norms_of(each[2]) / 3)
            opt.step()


class _WeightNormed(nn.Module):
    """A weight-normalized Linear (``parametrizations.weight_norm``) called twice per forward,
    on the input and on its negation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)
        nn.utils.parametrizations.weight_norm(self.a)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) + torch.tanh(self.a(-x)))


def test_a_parametrization_cached_for_the_forward():
    """``with torch.nn.utils.parametrize.cached(): out = model(x)``, the parametrizations'
    documented way to compute a parametrized weight once per forward however often it is
    used: the weight-normalized layer's two calls share one ``weight`` tensor, and grad1 of
    ``original0`` (the norm) and ``original1`` (the direction) is the float64 loop's, which
    runs without the cache, at every step of SGD."""
    model = _WeightNormed().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            with torch.nn.utils.parametrize.cached():
                out = model(x)
            F.cross_entropy(out, y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copied", "bucket_view"])
def test_ddp_in_one_process_accumulating_under_no_sync(bucket_view, tmp_path):
    """A ``DistributedDataParallel`` model (one process, gloo), three micro-batches per step,
    the first two under ``ddp.no_sync()`` and the last one synchronizing, ``loss / 3`` (what
    ``Accelerator.accumulate`` enters: huggingface/accelerate, ``src/accelerate/accelerator.py``),
    with and without ``gradient_as_bucket_view`` (DDP then makes each ``.grad`` a view of its
    bucket): grad1 adds up over the micro-batches as ``.grad`` does, the mean of the float64
    loop's of each, and ``grad1.mean(0)`` is ``.grad``."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, and no process group of another test's")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradhooks.add_hooks(model):
            ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
            for step in range(STEPS):
                micro = [batch(10 * step + k) for k in range(3)]
                each = [loop_grad(model, F.cross_entropy, xb, yb) for xb, yb in micro]
                want = {n: sum(w[n] for w in each) / 3 for n in each[0]}
                opt.zero_grad()
                for k, (xb, yb) in enumerate(micro):
                    with ddp.no_sync() if k < 2 else contextlib.nullcontext():
                        (F.cross_entropy(ddp(xb), yb) / 3).backward()
                assert_grad1(model, want, f"step {step}")
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.grad1.mean(0), p.grad, msg=n)
                opt.step()
    finally:
        dist.destroy_process_group()


def test_float16_grad_scaler_norms_and_squared_sums_are_of_the_scaled_loss():
    """The PyTorch AMP recipe on the CPU (pytorch/tutorials,
    ``recipes_source/recipes/amp_recipe.py``): float16 autocast, ``scaler.scale(loss)
    .backward()``, ``unscale_``, ``clip_grad_norm_``, ``scaler.step``, ``scaler.update()``,
    growing the scale at every step (``growth_interval=1``), with an overflow at the third
    step (an input of 1e30). As ``grad1``, the norms and squared sums are those of the scaled
    loss: ``norms / S`` and ``sum_grad_sq / S²`` (``S`` read before ``update``) are within
    float16's rounding of the float64 loop's at every finite step; the overflow's norms are
    not finite, the scaler skips that step (the parameters stay) and halves ``S``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq")) as hooks:
        for step in range(4):
            x, y = batch(step, dtype=torch.float32)
            if step == 2:
                x = x * 1e30
            want = loop_grad(copy.deepcopy(model).to(D), F.cross_entropy, x.to(D), y)
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            norms, squares = hooks.norms(), hooks.sum_grad_sq()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if step == 2:
                assert not torch.isfinite(norms).all()
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
                assert scaler.get_scale() == scale / 2
                continue
            assert scaler.get_scale() == scale * 2
            torch.testing.assert_close(norms.to(D) / scale, norms_of(want), rtol=1e-2, atol=0)
            for n, sq in squares.items():
                ref = want[n].square().sum(0)
                err = (sq.to(D) / scale**2 - ref).abs().max() / ref.abs().max()
                assert err < 2e-2, f"step {step} {n}: {err:.2e} of the largest entry"


# -- inputs ---------------------------------------------------------------------------------------


def test_a_universal_perturbation_that_requires_grad_updated_from_its_grad():
    """Free adversarial training with one perturbation for every example (``delta``,
    ``[1, features]``, ``requires_grad``, broadcast onto the batch): each minibatch replayed
    twice, one backward giving both the parameters' gradients and ``delta.grad``, then
    ``delta += eps * delta.grad.sign()``. grad1 and the norms are the float64 loop's at the
    perturbed inputs, and ``delta.grad`` (no per-example gradient: not a parameter) is what
    autograd gives an unhooked twin."""
    model, twin = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    delta = torch.zeros(1, 3, dtype=D, requires_grad=True)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(2):
            x, y = batch(step)
            for replay in range(2):
                want = loop_grad(model, F.cross_entropy, x + delta.detach(), y)
                twin_delta = delta.detach().clone().requires_grad_()
                for m, o, d in ((model, opt, delta), (twin, twin_opt, twin_delta)):
                    o.zero_grad()
                    d.grad = None
                    F.cross_entropy(m(x + d), y).backward()
                assert_grad1(model, want, f"step {step}, replay {replay}")
                torch.testing.assert_close(hooks.norms(), norms_of(want))
                torch.testing.assert_close(delta.grad, twin_delta.grad)
                assert not hasattr(delta, "grad1")
                opt.step()
                twin_opt.step()
                with torch.no_grad():
                    delta += 0.1 * delta.grad.sign()


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_batches_of_one_example_through_the_norms_and_the_dp_step(quantity):
    """Batches of a single example at every step: ``grad1[0]`` is ``.grad``, the norm is that
    of the float64 loop's row, and ``dp_sgd_step`` without noise writes ``min(1, C/‖g‖)·g``
    (clipped at the second step, where the bound is below the norm), by ``grad1`` or by the
    book-keeping of the norms."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=(quantity,)) as hooks:
        for step in range(STEPS):
            x, y = batch(step, n=1)
            want = loop_grad(model, F.cross_entropy, x, y)
            norm = norms_of(want)
            if quantity == "grad1":
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                assert_grad1(model, want, f"step {step}")
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.grad1[0], p.grad, msg=n)
            bound = float(norm[0]) * (0.5 if step == 1 else 2.0)
            losses = F.cross_entropy(model(x), y, reduction="none")
            got = gradhooks.dp_sgd_step(hooks, losses, max_norm=bound, noise_multiplier=0.0)
            torch.testing.assert_close(got, norm)
            factor = min(1.0, bound / float(norm[0]))
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, factor * want[n][0], msg=n)
            opt.step()


# -- misuse ---------------------------------------------------------------------------------------


def test_hooks_removed_in_the_middle_of_an_accumulation_and_added_again():
    """Three micro-batches of one step: the first backward hooked, the hooks removed (the
    second runs without them), then added again for the third. grad1 holds what the hooks
    saw, the first and the third micro-batches' rows (the float64 loop's), while ``.grad``
    holds all three; ``hooks.check()`` says so (a CheckFailedError: ``.grad`` holds a backward
    that was not captured). After the next ``zero_grad`` the two agree again."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = [batch(k) for k in range(3)]
    each = [loop_grad(model, F.cross_entropy, xb, yb) for xb, yb in micro]
    hooks = gradhooks.add_hooks(model)
    opt.zero_grad()
    for k, (xb, yb) in enumerate(micro):
        if k == 2:
            hooks = gradhooks.add_hooks(model)
        (F.cross_entropy(model(xb), yb) / 3).backward()
        if k == 0:
            hooks.remove()
    assert_grad1(model, {n: (each[0][n] + each[2][n]) / 3 for n in each[0]}, "hooked two")
    with pytest.raises(gradhooks.CheckFailedError, match="not captured"):
        hooks.check()
    opt.step()
    opt.zero_grad()
    x, y = batch(5)
    want = loop_grad(model, F.cross_entropy, x, y)
    F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "the next step")
    hooks.check()
    hooks.remove()

"""Norms, squared sums, variance, DP-SGD and Jacobians against the per-example loop oracle, on
every case of tests/cases.py (every registered layer type, reused modules, tied weights)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cases import CASES, CASES_BY_LAYER
from torch import nn

import gradhooks
from gradhooks.models import EmbedBlock, SimpleCNN
from gradhooks.oracle import loop_grad
from harness import Case, _double, assert_close


def setup(case: Case, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = case.model().double()
    inputs = _double(case.inputs(batch))
    target = case.target(batch) if case.target else None
    return model, inputs, target


def forward_loss(model, case, inputs, target, reduction):
    out = model(inputs)
    loss = case.loss(out) if target is None else case.loss(out, target)
    return loss / max(inputs.shape[0], 1) if reduction == "mean" else loss


def per_example_losses(model, case, inputs, target):
    """[batch] own losses from one batched forward (the cases' losses are sums over examples)."""
    out = model(inputs)
    return torch.stack(
        [case.loss(out[i : i + 1]) if target is None else case.loss(out[i : i + 1], target[i : i + 1])
         for i in range(inputs.shape[0])]
    )  # fmt: skip


def test_every_registered_layer_has_a_quantity_case():
    missing = [t.__qualname__ for t in gradhooks.REGISTRY.types() if t not in CASES_BY_LAYER]
    # types registered by name: where their library imports here
    cased = {f"{t.__module__}.{t.__qualname__}" for t in CASES_BY_LAYER}
    for name in gradhooks.REGISTRY.names():
        if importlib.util.find_spec(name.split(".")[0]) is not None and name not in cased:
            missing.append(name)
    assert not missing, f"add cases for {missing} to tests/cases.py (CASES_BY_LAYER)"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 4])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_norms_and_squared_sums(case, batch, reduction):
    if batch == 0 and case.id.startswith("instance_norm"):
        pytest.skip("torch's own instance_norm fails on an empty batch")
    model, inputs, target = setup(case, batch)
    gradhooks.clear_grad1(model)  # (the cases share layers: another test's grad1 stays on them)
    loop = loop_grad(model, case.loss, inputs, target)
    with gradhooks.add_hooks(model, reduction, quantities=("norms", "sum_grad_sq")) as h:
        forward_loss(model, case, inputs, target, reduction).backward()
    for name, p in model.named_parameters():
        assert not hasattr(p, "grad1"), f"{case.id}: grad1 was formed for {name}"
    param_norms, sums, variances = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    assert set(param_norms) == set(loop), f"{case.id}: {sorted(param_norms)} != {sorted(loop)}"
    for name, g in loop.items():
        what = f"{case.id} ({reduction}, batch {batch}): {name}"
        assert_close(param_norms[name], g.flatten(1).norm(dim=1), f"{what} norm")
        assert_close(sums[name], (g**2).sum(0), f"{what} sum_grad_sq")
        if batch:
            assert_close(variances[name], g.var(0, unbiased=False), f"{what} variance")
    if batch:
        total = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
        assert_close(h.norms(), total, f"{case.id}: total norm")
    if batch > 1:
        want = oracle_noise_scale(loop)
        got = h.noise_scale()
        assert_close(got.trace, want.trace, f"{case.id}: tr(Σ)")
        # (|G|² is a difference of two terms of the trace's order: compared on their scale)
        scale = float(want.trace) / batch + float(want.grad_sq.abs())
        assert abs(float(got.grad_sq - want.grad_sq)) <= 1e-9 * scale, f"{case.id}: |G|²"
    elif batch == 1:
        with pytest.raises(gradhooks.StateError, match="at least 2"):
            h.noise_scale()


def oracle_noise_scale(per_example: dict) -> gradhooks.NoiseScale:
    """The noise scale's estimates from the oracle's per-example gradients: the unbiased
    variance over the batch, summed over every entry of every parameter, and ``|mean|² - S/B``."""
    g = torch.cat([v.flatten(1) for v in per_example.values()], 1).double()
    trace = g.var(0, unbiased=True).sum()
    grad_sq = g.mean(0).square().sum() - trace / g.shape[0]
    return gradhooks.NoiseScale(trace, grad_sq, trace / grad_sq)


def test_norms_of_a_direct_piece_tied_to_an_outer_one():
    """A parameter used by a Direct rule and an Outer rule at once: cross terms between the
    two piece types (through materialization)."""

    class Scale(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, x):  # x [batch, 3, 4] * weight [3, 4]
            return x * self.weight

    registry = gradhooks.Registry()
    registry.register(nn.Linear)(gradhooks.REGISTRY.lookup(nn.Linear(1, 1)).rule)

    @registry.register(Scale)
    def scale(call):
        (x,) = call.inputs
        return {"weight": gradhooks.Direct(x * call.grad_output)}

    lin = nn.Linear(4, 3, bias=False)
    model = nn.Sequential(
        lin, nn.Tanh(), nn.Unflatten(1, (3, 1)), Scale(lin.weight), nn.Flatten()
    ).double()
    case = Case("direct_tied", lambda: model, lambda b: torch.randn(b, 4))
    x = torch.randn(5, 4, dtype=torch.float64)
    loop = loop_grad(model, case.loss, x)
    with gradhooks.add_hooks(
        model, "sum", registry=registry, quantities=("norms", "sum_grad_sq")
    ) as h:
        case.loss(model(x)).backward()
    assert_close(
        h.param_norms()["0.weight"], loop["0.weight"].flatten(1).norm(dim=1), "direct+outer norm"
    )
    assert_close(h.sum_grad_sq()["0.weight"], (loop["0.weight"] ** 2).sum(0), "direct+outer sum_sq")


def test_norms_each_backward_replaces_and_clear_resets():
    case = CASES_BY_LAYER[nn.Linear][0]
    model, inputs, target = setup(case, 3)
    with gradhooks.add_hooks(model, "sum", quantities=("norms",)) as h:
        forward_loss(model, case, inputs, target, "sum").backward()
        first = h.norms()
        forward_loss(model, case, 2 * inputs, target, "sum").backward()
        assert not torch.allclose(h.norms(), first)
        h.clear()
        with pytest.raises(gradhooks.StateError, match="no backward"):
            h.norms()
        with pytest.raises(gradhooks.StateError, match="quantities"):
            h.sum_grad_sq()


def test_bad_quantity_name():
    with pytest.raises(gradhooks.ConfigurationError, match="quantities must be"):
        gradhooks.add_hooks(nn.Linear(2, 2), quantities=("grad2",))


# -- DP-SGD -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_dp_clipping_equals_clipped_loop_oracle(case, method, reduction):
    batch = 5
    model, inputs, target = setup(case, batch, seed=1)
    loop = loop_grad(model, case.loss, inputs, target)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm = norms.median().item()  # some examples clipped, some not
    assert (norms > max_norm).any() and (norms < max_norm).any(), f"{case.id}: {norms}"
    factors = torch.clamp(max_norm / norms, max=1.0)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        losses = per_example_losses(model, case, inputs, target)
        got_norms = gradhooks.dp_sgd_step(
            h, losses, max_norm=max_norm, noise_multiplier=0.0, reduction=reduction,
            method=method,
        )  # fmt: skip
    assert_close(got_norms, norms, f"{case.id}: norms")
    denom = batch if reduction == "mean" else 1
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", factors, loop[name]) / denom
        assert_close(p.grad, want, f"{case.id} ({method}, {reduction}): clipped {name}")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_noise_is_reproducible_and_calibrated(method):
    case = CASES_BY_LAYER[nn.Linear][1]
    model, inputs, target = setup(case, 4)
    params = list(model.parameters())
    grads = []
    for noise in (0.0, 1.3, 1.3):
        with gradhooks.add_hooks(
            model, quantities=("grad1" if method == "grad1" else "norms",)
        ) as h:
            losses = per_example_losses(model, case, inputs, target)
            gradhooks.dp_sgd_step(
                h, losses, max_norm=0.5, noise_multiplier=noise, reduction="sum",
                generator=torch.Generator().manual_seed(7), method=method,
            )  # fmt: skip
        grads.append([p.grad.clone() for p in params])
    clean, noisy, again = grads
    gen = torch.Generator().manual_seed(7)
    for c, n, a, p in zip(clean, noisy, again, params):
        assert torch.equal(n, a), "same generator seed, different noise"
        want = 1.3 * 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
        assert_close(n - c, want, "noise = noise_multiplier * max_norm * N(0, 1)")


def test_dp_refuses_a_handle_without_the_quantity():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        losses = model(torch.randn(4, 3)).sum(1)
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)


METHODS = pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])


def _mlp_and_batch(batch=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    return model, torch.randn(batch, 3, dtype=torch.float64)


def _hooked(model, method):
    return gradhooks.add_hooks(model, quantities=("grad1" if method == "grad1" else "norms",))


@METHODS
@pytest.mark.parametrize(
    "max_norm, noise",
    [
        (0.0, 1.0),
        (-1.0, 0.0),
        (float("nan"), 0.0),
        (float("inf"), 0.0),
        (1.0, -1.0),
        (1.0, float("nan")),
    ],  # fmt: skip
)
def test_dp_refuses_clipping_or_noise_that_bounds_nothing(method, max_norm, noise):
    """A negative max_norm would flip every gradient, NaN or Inf would clip nothing, 0 would
    leave the noise alone: refused, no gradient written."""
    model, x = _mlp_and_batch()
    with _hooked(model, method) as h:
        with pytest.raises(
            gradhooks.ConfigurationError, match="max_norm must be|noise_multiplier must be"
        ):
            gradhooks.dp_sgd_step(
                h, model(x).pow(2).sum(1), max_norm=max_norm, noise_multiplier=noise,
                method=method,
            )  # fmt: skip
    assert all(p.grad is None for p in model.parameters())


@METHODS
def test_dp_refuses_losses_that_are_not_one_per_example(method):
    """Per-token losses ``[batch * seq]`` passed as they come: one per example is needed
    (else the sum would be divided by the token count), refused before any gradient."""
    model, x = _mlp_and_batch()
    with _hooked(model, method) as h:
        losses = model(x).pow(2).reshape(-1)  # [4 * 2]
        with pytest.raises(
            gradhooks.ConfigurationError, match="has 8 entries, but the hooked forward had a batch"
        ):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
    assert all(p.grad is None for p in model.parameters())


NOT_OWN = {
    # a penalty on the parameters added to each example's loss: not in the hooks' gradients
    "penalty": lambda model, out: out.pow(2).sum(1) + 0.1 * model[0].weight.pow(2).sum(),
    # each example's loss depends on the other examples' outputs (in-batch negatives)
    "coupled": lambda model, out: torch.nn.functional.cross_entropy(
        out @ out.T, torch.arange(out.shape[0]), reduction="none"
    ),
}


@METHODS
@pytest.mark.parametrize("how", list(NOT_OWN))
def test_dp_refuses_a_loss_that_is_not_each_examples_own(method, how):
    """Clipping bounds each example's influence only where each loss is that example's own:
    the first step checks one example's gradient against autograd's of its own loss, and
    refuses, writing no gradient."""
    model, x = _mlp_and_batch()
    with _hooked(model, method) as h:
        losses = NOT_OWN[how](model, model(x))
        with pytest.raises(
            gradhooks.CheckFailedError,
            match="dp_sgd_step: (example 3|the per-example gradients)|grad1 does not add up",
        ):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
    assert all(p.grad is None for p in model.parameters())


class _Checkpointed(nn.Module):
    """Two blocks under reentrant activation checkpointing, which ``torch.autograd.grad``
    does not run again (Hugging Face's ``gradient_checkpointing_enable`` uses it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        x = x.requires_grad_()  # (as enable_input_require_grads does)
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=True
        )
        return self.head(h)


@METHODS
def test_dp_step_through_reentrant_checkpointing(method):
    torch.manual_seed(0)
    model = _Checkpointed().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    loss = lambda out: out.pow(2).sum()
    loop = loop_grad(model, loss, x.clone())
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    factors = torch.clamp(max_norm / norms, max=1.0)
    with _hooked(model, method) as h:
        got = gradhooks.dp_sgd_step(
            h, model(x.clone()).pow(2).sum(1), max_norm=max_norm, noise_multiplier=0.0,
            method=method, reduction="sum",
        )  # fmt: skip
    assert_close(got, norms, "norms")
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", factors, loop[name])
        assert_close(p.grad, want, f"{method}: clipped {name}")


# -- Jacobians ----------------------------------------------------------------------------------


def vmap_jacrev(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(sample):
        call = lambda p: torch.func.functional_call(model, (p, buffers), (sample[None],))[0]
        return torch.func.jacrev(call)(params)  # {name: [*out, *p.shape]}

    with gradhooks.paused():
        return torch.vmap(one)(x)


class SeedMLP(nn.Module):
    """The MLP of the per-example Jacobian question (seed 003)."""

    def __init__(self, input_size=784, hidden_size=20, output_size=10):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def loop_jacobians(model, x):
    """{name: [batch, outputs, *p.shape]} by one backward per example and output."""
    names = [n for n, p in model.named_parameters()]
    params = list(model.parameters())
    rows = []
    with gradhooks.paused():
        for b in range(x.shape[0]):
            out = model(x[b : b + 1]).flatten()
            rows.append([torch.autograd.grad(o, params, retain_graph=True) for o in out])
    return {
        n: torch.stack([torch.stack([r[i] for r in row]) for row in rows])
        for i, n in enumerate(names)
    }


def check_jacobians(model, inputs, want, what):
    got = gradhooks.jacobians(model, inputs)
    for name, w in want.items():
        assert_close(got[name], w, f"{what}: Jacobian of {name}")
    flat = gradhooks.jacobians(model, inputs, flatten=True)
    batch, outputs = flat.shape[:2]
    assert_close(
        flat, torch.cat([w.reshape(batch, outputs, -1) for w in want.values()], -1), f"{what}: flat"
    )


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_jacobians_equal_the_loop_oracle(case):
    model, inputs, _ = setup(case, 3)
    check_jacobians(model, inputs, loop_jacobians(model, inputs), case.id)


@pytest.mark.parametrize("model", [SeedMLP, SimpleCNN], ids=["seed003_mlp", "simple_cnn"])
def test_jacobians_equal_vmap_jacrev(model):
    torch.manual_seed(0)
    model = model().double()
    shape = (784,) if isinstance(model, SeedMLP) else (1, 28, 28)
    inputs = torch.randn(2, *shape, dtype=torch.float64)
    want = vmap_jacrev(model, inputs)
    check_jacobians(model, inputs, want, type(model).__name__)


def test_jacobians_of_a_reused_linear_over_positions():
    """A Linear over positions, called twice: the flattened result takes one product per
    output into each output's block (added to for the second call), against the loop."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):  # x [batch, positions, 4]
            return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))).mean(1))

    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    check_jacobians(model, x, loop_jacobians(model, x), "Linear over positions, twice")


def test_jacobians_of_an_empty_batch():
    model = SeedMLP(6, 4, 3)
    assert gradhooks.jacobians(model, torch.randn(0, 6), flatten=True).shape == (0, 3, 43)


class TiedEmbed(nn.Module):
    """An Embedding looked up twice and tied to the output Linear (padding row 0): the
    Jacobian of its weight sums an Outer piece and two Rows pieces."""

    def __init__(self, vocab=6, dim=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens) + self.embed(tokens.flip(1)).tanh()
        return self.head(h.mean(1))


@pytest.mark.parametrize(
    "make", [TiedEmbed, lambda: EmbedBlock(vocab=9, dim=4, classes=3)], ids=["tied", "block"]
)
def test_jacobians_of_embeddings_scatter_rows(make, monkeypatch):
    """Embedding Jacobians by :meth:`Rows.jacobian_into` (one scatter into the result, repeated
    tokens and padding included) equal vmap(jacrev) and the loop."""
    from gradhooks.pieces import Rows

    used = []
    original = Rows.jacobian_into
    monkeypatch.setattr(Rows, "jacobian_into", lambda *a: used.append(original(*a)) or used[-1])
    torch.manual_seed(0)
    model = make().double()
    tokens = torch.randint(model.embed.num_embeddings, (3, 5))
    tokens[0, :3] = tokens[0, 3]  # a token repeated within an example
    tokens[1, 1] = 0  # the padding row, in TiedEmbed
    check_jacobians(model, tokens, vmap_jacrev(model, tokens), "embeddings")
    check_jacobians(model, tokens, loop_jacobians(model, tokens), "embeddings")
    assert used and all(used)


def test_gradient_mean_is_formed_only_when_asked_where_its_pieces_are_small(monkeypatch):
    """With sum_grad_sq, an Embedding and Linears on ``[batch, features]`` (whose ``.grad``
    autograd forms, or the embedding's lookups at once) get their gradient means from their
    pieces only when grad_variance() asks, once, where keeping the pieces takes no more memory
    than the mean (the embedding's 20 lookups of 8 floats for its 400, the hidden layer's
    4 x (8 + 16) for its 128); the head's 4 x (16 + 3) for its 48 is formed at once. The results are the oracle's, also after the
    parameters changed in between."""
    from gradhooks import pieces as P

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.hidden = nn.Linear(8, 16)
            self.out = nn.Linear(16, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.hidden(self.embed(x).mean(1))))

    # (a Linear run detached takes .grad from the same product, formed at once then)
    monkeypatch.setattr(gradhooks.TUNING, "sum_grad1_positions", 32)
    torch.manual_seed(6)
    model = Model().double()
    x, y = torch.randint(50, (4, 5)), torch.randint(3, (4,))
    loss_fn = nn.functional.cross_entropy
    want = loop_grad(model, loss_fn, x, y)
    formed = []
    for kind in (P.Outer, P.Direct, P.Rows):
        real = kind.batch_sum
        monkeypatch.setattr(
            kind, "batch_sum", lambda piece, *a, real=real: formed.append(piece) or real(piece, *a)
        )
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        loss_fn(model(x), y).backward()
        weights = [pc for pc in formed if not isinstance(pc, P.Outer) or pc.has_input]
        # (the embedding runs with its table detached: its .grad is the sum of its lookups,
        # formed at once, as autograd's was)
        assert [type(pc) for pc in weights] == [P.Outer, P.Rows], "the head's and the table's"
        assert weights[0].g.shape[-1] == 3, "of the Linears, only the head's mean at once"
        for name, sq in h.sum_grad_sq().items():
            assert_close(sq, want[name].square().sum(0), f"{name} squared sums")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # (an optimizer step: the mean is of the backward's gradients)
        first = h.grad_variance()
        count = len(formed)
        again = h.grad_variance()
        assert len(formed) == count, "the mean was formed twice"
    for name, v in first.items():
        assert_close(v, want[name].var(0, unbiased=False), f"{name} gradient variance")
        assert torch.equal(again[name], v)


class _KeyBias(nn.Module):
    """Attention whose key bias has a gradient of zero (softmax is blind to a constant added
    to a query's scores): compared with autograd, only rounding on both sides."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # [batch, seq, 4]
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return (torch.softmax(scores, -1) @ self.v(x)).sum(1)


@METHODS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_dp_step_with_a_parameter_whose_gradient_is_zero(method, dtype):
    torch.manual_seed(0)
    model = _KeyBias().to(dtype)
    x = torch.randn(5, 3, 4, dtype=dtype)
    loop = loop_grad(model, lambda out: out.pow(2).sum(), x)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    with _hooked(model, method) as h:
        got = gradhooks.dp_sgd_step(
            h, model(x).pow(2).sum(1), max_norm=1e6, noise_multiplier=0.0, method=method,
            reduction="sum",
        )  # fmt: skip
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, norms, **tol)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, loop[name].sum(0), **tol)


@METHODS
def test_dp_refuses_a_generator_that_is_not_one(method):
    model, x = _mlp_and_batch()
    with _hooked(model, method) as h:
        with pytest.raises(gradhooks.ConfigurationTypeError):
            gradhooks.dp_sgd_step(
                h, model(x).pow(2).sum(1), max_norm=1.0, noise_multiplier=1.0, generator=0,
                method=method,
            )  # fmt: skip
    assert all(p.grad is None for p in model.parameters())


@METHODS
def test_dp_refuses_mixing_of_two_examples_the_tracker_cannot_see(method):
    """A gradient hook that adds the second example's output-gradient to the first's: every
    method's check of the first step (all examples weighted, also for the norms) refuses it,
    and nothing is written."""
    model, x = _mlp_and_batch()

    def forward(x):
        h = model[1](model[0](x))
        h.register_hook(lambda g: torch.cat([g[:1] + g[1:2], g[1:]]))
        return model[2](h)

    with _hooked(model, method) as h:
        with pytest.raises(gradhooks.CheckFailedError):
            gradhooks.dp_sgd_step(h, forward(x).pow(2).sum(1), max_norm=1.0,
                                  noise_multiplier=0.0, method=method)  # fmt: skip
    assert all(p.grad is None for p in model.parameters())


def test_noise_scale_in_a_training_loop_and_under_bf16_autocast():
    """Each step's noise scale, with zero_grad and SGD between steps, against the float64
    loop's; under bf16 autocast within bfloat16's rounding (8 significant bits: the trace, a
    sum of squares, to 5e-2); asked of a handle without "sum_grad_sq", or before a backward,
    refused."""
    torch.manual_seed(0)
    model = SimpleCNN().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ce = torch.nn.functional.cross_entropy
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        with pytest.raises(gradhooks.StateError, match="no backward"):
            h.noise_scale()
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(6, 1, 28, 28, dtype=torch.float64, generator=gen)
            y = torch.randint(10, (6,), generator=gen)
            want = oracle_noise_scale(loop_grad(model, ce, x, y))
            opt.zero_grad()
            ce(model(x), y).backward()
            got = h.noise_scale()
            assert_close(got.trace, want.trace, f"step {step}: tr(Σ)")
            assert_close(got.simple, want.simple, f"step {step}: B_simple")
            opt.step()
        ref = oracle_noise_scale(loop_grad(model, ce, x, y))
        model.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ce(model(x.float()), y)
        loss.backward()
        got = h.noise_scale()
        assert abs(float(got.trace / ref.trace) - 1) < 5e-2
    with gradhooks.add_hooks(model) as h, pytest.raises(gradhooks.StateError, match="sum_grad_sq"):
        h.noise_scale()

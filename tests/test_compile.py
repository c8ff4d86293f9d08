"""A hooked model under ``torch.compile`` (``gradhooks/engine/compiled.py``): the first of
gradhooks' hooks a compiled call reaches is one graph break, after which the call runs eagerly,
every torch function seen by the batch tracker. grad1, the norms and a DP step on
``torch.compile(model)`` equal the eager model's, bit for bit, and the float64 per-example
loop's, over the steps of a training loop (``zero_grad``, the hooks cleared, an SGD step);
dynamo compiles no graph of a hooked forward and does not compile again after the first step;
once the hooks are removed, the model compiles as without gradhooks. ``fullgraph=True`` is
refused (``tests/test_torch_features.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks import _torch
from gradhooks.oracle import loop_grad
from harness import Logits, assert_close, hf, mlp, sq

D = torch.float64
STEPS = 3


class Net(nn.Module):
    """An MLP whose forward is its own code (dynamo compiles it once the hooks are gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * 2 + 1)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3)
        self.out = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.conv(x))).flatten(1))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    hf("GPT2LMHeadModel")
    config = transformers.GPT2Config(
        n_embd=8, n_layer=2, n_head=2, vocab_size=11, n_positions=8,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    return Logits(transformers.GPT2LMHeadModel(config))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# name -> (model factory, input factory); float64, seeded
MODELS = {
    "mlp": (Net, lambda: torch.randn(4, 3, dtype=D, generator=_generator(1))),
    "sequential": (mlp, lambda: torch.randn(4, 3, dtype=D, generator=_generator(1))),
    "cnn": (CNN, lambda: torch.randn(4, 2, 6, 6, dtype=D, generator=_generator(2))),
    "gpt2": (_gpt2, lambda: torch.randint(11, (4, 6), generator=_generator(3))),
}


def model_of(kind: str) -> tuple[nn.Module, torch.Tensor]:
    make, x_of = MODELS[kind]
    torch.manual_seed(0)
    return make().to(D), x_of()


def mse(out):
    return 0.5 * out.pow(2).flatten(1).sum(1)  # each example's loss, [batch]


def counts() -> tuple[int, int, int]:
    """(frames dynamo compiled, graphs it made, graph breaks) so far."""
    from torch._dynamo.utils import counters

    return (
        counters["frames"]["total"],
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
    )


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for n in want:
        assert torch.equal(got[n], want[n]), f"{what}: {n} differs"


# -- grad1 and the norms over a training loop ---------------------------------------------------


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_training_loop_on_the_compiled_model_equals_the_eager_one(dynamo, kind, quantity):
    """Two copies, one compiled: each step their grad1 (or per-example norms) are equal, and
    the float64 loop's (on an unhooked copy of the weights the step starts from)."""
    eager, x = model_of(kind)
    model = copy.deepcopy(eager)
    hooks = [
        gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)) for m in (eager, model)
    ]
    compiled = torch.compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(STEPS):
        want = loop_grad(copy.deepcopy(eager), sq, x)
        got = {}
        for m, run, h, opt in zip((eager, model), (eager, compiled), hooks, opts):
            opt.zero_grad()
            h.clear()
            gradhooks.clear_grad1(m)
            sq(run(x)).backward()
            if quantity == "grad1":
                got[run is compiled] = {n: p.grad1 for n, p in m.named_parameters()}
            else:
                got[run is compiled] = {**h.param_norms(), "": h.norms()}
        what = f"{kind}, {quantity}, step {step}"
        assert_equal(got[True], got[False], what)
        if quantity == "norms":
            want = {n: g.flatten(1).norm(dim=1) for n, g in want.items()}
            want[""] = torch.stack(list(want.values())).pow(2).sum(0).sqrt()
        for n in want:
            assert_close(got[True][n], want[n], f"{what}: {n} against the loop")
        for opt in opts:
            opt.step()
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt2"])
def test_dp_step_on_the_compiled_model_equals_the_eager_one(dynamo, kind):
    """The book-keeping DP step (norms, clipping, noise from one seed each) on the compiled
    model: the same norms and noisy .grad as on the eager model, step after step; the norms the
    float64 loop's."""
    eager, x = model_of(kind)
    model = copy.deepcopy(eager)
    hooks = [gradhooks.add_hooks(m, quantities=("norms",)) for m in (eager, model)]
    compiled = torch.compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    gens = [_generator(7), _generator(7)]
    for step in range(STEPS):
        want = loop_grad(copy.deepcopy(eager), sq, x)
        norms, grads = [], []
        for m, run, h, opt, gen in zip((eager, model), (eager, compiled), hooks, opts, gens):
            opt.zero_grad()
            h.clear()
            norms.append(
                gradhooks.dp_sgd_step(
                    h, mse(run(x)), max_norm=0.5, noise_multiplier=1.0, generator=gen
                )
            )
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
        what = f"{kind}, DP step {step}"
        assert torch.equal(norms[1], norms[0]), what
        assert_equal(grads[1], grads[0], what)
        flat = torch.cat([g.flatten(1) for g in want.values()], 1)
        assert_close(norms[1], flat.norm(dim=1), f"{what}: norms against the loop")
    for h in hooks:
        h.remove()


# -- what dynamo does -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlp", "sequential"])
def test_one_graph_break_per_call_and_no_recompilation(dynamo, kind):
    """The hooked forward runs eagerly from its first hook: dynamo makes no graph of it, breaks
    once per call (not at each torch function the tracker sees), and compiles nothing again
    after the first step."""
    model, x = model_of(kind)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        compiled = torch.compile(model)
        start = counts()
        h.clear()
        sq(compiled(x)).backward()
        first = counts()
        for step in range(STEPS):
            h.clear()
            sq(compiled(x)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{kind}, step {step}: {n}")
        assert counts() == first, f"dynamo compiled again: {first} -> {counts()}"
        frames, graphs, breaks = (a - b for a, b in zip(first, start))
        assert graphs == 0, "a graph of the hooked forward"
        assert breaks <= 2, f"{breaks} graph breaks in one call"


@pytest.mark.parametrize("kind", ["mlp", "sequential"])
def test_a_new_batch_size_at_each_step_past_the_recompile_limit(dynamo, kind):
    """Shapes not marked dynamic: dynamo compiles again at each batch size until its recompile
    limit (8), then runs the frame as it is, with its nested frames still compiled: the hooks
    run for real there, and turn compilation off for the rest of the call. grad1 the loop's
    at every size."""
    model, _ = model_of(kind)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        compiled = torch.compile(model, dynamic=False)
        for batch in range(1, 12):
            x = torch.randn(batch, 3, dtype=D, generator=_generator(batch))
            want = loop_grad(model, sq, x)
            h.clear()
            sq(compiled(x)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{kind}, batch {batch}: {n}")


def test_a_compiled_training_step(dynamo):
    """``torch.compile`` of a whole step (forward, loss, backward): grad1 the loop's, step
    after step; the rest of the step after the model's first hook runs eagerly."""
    model, x = model_of("mlp")
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:

        @torch.compile
        def step(x):
            sq(model(x)).backward()

        for i in range(STEPS):
            h.clear()
            gradhooks.clear_grad1(model)
            step(x)
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {i}: {n}")


def test_after_remove_hooks_the_model_compiles_again(dynamo):
    """Hooked, the compiled forward runs eagerly; with the hooks removed, the same compiled
    model makes a graph of its forward, and its .grad is the eager model's."""
    model, x = model_of("mlp")
    compiled = torch.compile(model)
    graphs = counts()[1]
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(compiled(x)).backward()
    assert counts()[1] == graphs
    gradhooks.clear_grad1(model)
    model.zero_grad()
    sq(model(x)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for _ in range(2):
        model.zero_grad()
        sq(compiled(x)).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad, want[n], f"compiled after remove_hooks: {n}")
    assert counts()[1] > graphs, "no graph compiled after remove_hooks"
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_without_leaving_compilation_the_hooks_run_through_disable(dynamo):
    """Where torch's frame evaluation cannot be turned off (``_torch.disabled("eval_frame")``,
    the internal's fallback): the hooks run through ``torch.compiler.disable`` and dynamo
    traces the forward between them, breaking at the tracker, slower but the same grad1."""
    model, x = model_of("mlp")
    want = loop_grad(model, sq, x)
    breaks = counts()[2]
    with _torch.disabled("eval_frame"):
        with gradhooks.add_hooks(model, loss_reduction="sum") as h:
            compiled = torch.compile(model)
            for step in range(2):
                h.clear()
                sq(compiled(x)).backward()
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"fallback, step {step}: {n}")
    assert counts()[2] - breaks > 2, "the fallback broke the graph only at the hooks"


@pytest.mark.parametrize("what", ["compiled-copy", "copy-compiled"])
def test_a_compiled_copy_of_a_hooked_model_trains(dynamo, what):
    """An EMA or teacher copy of a hooked model, compiled (``copy.deepcopy`` of the compiled
    model, or ``torch.compile`` of the copy): the copy is not hooked, and its compiled
    forward traced the hook its modules carry from the original (which deletes a copied
    ``grad1``) into a dynamo internal error. It now runs, gives the eager copy's ``.grad``
    and no ``grad1``, and the original's ``grad1`` is still the loop's."""
    model, x = model_of("mlp")
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        compiled = torch.compile(model)
        sq(compiled(x)).backward()
        eager = copy.deepcopy(model)
        if what == "compiled-copy":
            copied = copy.deepcopy(compiled)
        else:
            copied = torch.compile(copy.deepcopy(model))
        inner = getattr(copied, "_orig_mod", copied)
        sq(copied(x)).backward()
        with gradhooks.paused():
            sq(eager(x)).backward()
        for (n, p), q in zip(inner.named_parameters(), eager.parameters(), strict=True):
            assert not hasattr(p, "grad1"), n
            assert_close(p.grad, q.grad, f"the copy's .grad: {n}")
        want = loop_grad(model, sq, x)
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], f"the original's grad1: {n}")

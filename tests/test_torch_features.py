"""PyTorch features that touch a hooked model's parameters or its graph: ``functional_call``,
parametrizations in training mode, conversions that swap parameters (``swap_tensors``), nested
tensors and ``torch.compile``. Each gives ``grad1`` equal to the float64 per-example loop, or
is refused with an error naming the module and what to do."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, sq

D = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def x_of(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, dtype=D, generator=torch.Generator().manual_seed(1))


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    """``grad1`` against the loop's ``want``: in float64 at the harness's tolerances; in float32
    within its rounding (the loop's batches of one run other kernels than the batch, whose
    roundings differ from processor to processor)."""
    for n, p in model.named_parameters():
        assert hasattr(p, "grad1"), f"{what}: '{n}' has no grad1"
        if p.grad1.dtype == torch.float64:
            assert_close(p.grad1, want[n], f"{what}: {n}")
        else:
            scale = float(want[n].abs().max())
            torch.testing.assert_close(
                p.grad1, want[n].to(p.grad1.dtype), rtol=1e-5, atol=1e-6 * scale,
                msg=lambda m, n=n: f"{what}: {n}: {m}",
            )  # fmt: skip


# -- torch.func.functional_call -----------------------------------------------------------------


def loop_through(model: nn.Module, params_of, x: torch.Tensor, wrt: dict) -> dict:
    """The float64 loop: example i's loss ``sq(functional_call(model, params_of(), x[i:i+1]))``
    differentiated with respect to each tensor of ``wrt`` (``params_of`` recomputes the slots'
    tensors from them for every example)."""
    rows: dict[str, list] = {n: [] for n in wrt}
    with gradhooks.paused():
        for i in range(x.shape[0]):
            loss = sq(functional_call(model, params_of(), (x[i : i + 1],)))
            grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
            for n, g in zip(wrt, grads):
                rows[n].append(torch.zeros_like(wrt[n]) if g is None else g)
    return {n: torch.stack(r) for n, r in rows.items()}


def inner_grads(model, params: dict, support: torch.Tensor, create_graph: bool) -> dict:
    """One inner step's gradients (MAML) on a support batch, under gradhooks.paused()."""
    with gradhooks.paused():
        loss = sq(functional_call(model, params, (support,)))
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
    return dict(zip(params, grads))


def test_functional_call_with_the_models_parameters():
    model = mlp()
    x = x_of()
    own = dict(model.named_parameters())
    want = loop_through(model, lambda: own, x, own)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(functional_call(model, own, (x,))).backward()
    assert_grad1(model, want, "functional_call(model, own parameters)")


def test_functional_call_with_other_tensors():
    """Leaf tensors in place of the parameters: grad1 where autograd puts .grad, on them; the
    model's parameters, unused, get neither."""
    model = mlp()
    x = x_of()
    g = torch.Generator().manual_seed(3)
    other = {
        n: torch.randn(p.shape, dtype=D, generator=g).requires_grad_()
        for n, p in model.named_parameters()
    }
    want = loop_through(model, lambda: other, x, other)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(2):
            h.clear()
            sq(functional_call(model, other, (x,))).backward()
            for n, t in other.items():
                assert_close(t.grad1, want[n], f"step {step}: {n}")
            for n, p in model.named_parameters():
                assert not hasattr(p, "grad1") and p.grad is None, n
        # then the model's own forward again: its parameters hooked as before
        h.clear()
        sq(model(x)).backward()
    assert_grad1(model, loop_grad(model, sq, x), "the model's own forward after")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("order", ["first", "second"])
def test_functional_call_with_fast_weights(order, reduction):
    """MAML: fast = p - lr * g, g from an inner step on a support batch (detached: first
    order; with create_graph: second order). grad1 of the model's parameters is each query
    example's gradient with respect to p, through fast; first order, it is the gradient with
    respect to fast. Before, grad1 went on the fast tensors only and p got none, in silence."""
    model = mlp()
    x, support = x_of(), x_of(6) * 2
    own = dict(model.named_parameters())
    lr = 0.3

    def fast():
        g = inner_grads(model, own, support, create_graph=order == "second")
        return {n: p - lr * g[n] for n, p in own.items()}

    want = loop_through(model, fast, x, own)
    scale = 1.0 if reduction == "sum" else 1.0 / x.shape[0]
    with gradhooks.add_hooks(model, loss_reduction=reduction) as h:
        for step in range(2):
            h.clear()
            model.zero_grad()
            (sq(functional_call(model, fast(), (x,))) * scale).backward()
            assert_grad1(model, want, f"{order} order, step {step}")
            for n, p in model.named_parameters():
                got = p.grad1.sum(0) if reduction == "sum" else p.grad1.mean(0)
                assert_close(got, p.grad, f".grad of {n}")


class Doubled(torch.autograd.Function):
    """2 * p, whose backward reads a number from its gradient (no vmap: .item())."""

    @staticmethod
    def forward(ctx, p):
        return 2 * p

    @staticmethod
    def backward(ctx, g):
        return g * (2.0 if float(g.abs().max()) >= 0 else 0.0)


def test_functional_call_through_a_computation_vmap_cannot_batch():
    """The batched backward through the slot's computation fails: one example at a time."""
    model = mlp()
    x = x_of()
    own = dict(model.named_parameters())
    fast = lambda: {n: Doubled.apply(p) for n, p in own.items()}  # noqa: E731
    want = loop_through(model, fast, x, own)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(functional_call(model, fast(), (x,))).backward()
    assert_grad1(model, want, "through Doubled")


def test_functional_call_with_fast_weights_and_norms_is_refused():
    model = mlp()
    x = x_of()
    fast = {n: p - 0.1 for n, p in model.named_parameters()}
    with gradhooks.add_hooks(model, quantities=("norms",)):
        with pytest.raises(
            gradhooks.ConfigurationError, match=r"'0.weight' holds a tensor computed.*grad1"
        ):
            functional_call(model, fast, (x,))


def test_functional_call_with_fast_weights_under_bf16_autocast():
    """Linear on 2-D inputs under bfloat16 autocast: grad1 in float32 against the float64 loop,
    to bfloat16's precision (8 bits of mantissa: 2**-8 relative, on gradients of size ~1)."""
    model = mlp().float()
    x = x_of().float()
    own = dict(model.named_parameters())
    g = {n: torch.full_like(p, 0.1) for n, p in own.items()}
    ref = copy.deepcopy(model).double()
    ref_own = dict(ref.named_parameters())
    want = loop_through(ref, lambda: {n: p - g[n].double() for n, p in ref_own.items()},
                        x.double(), ref_own)  # fmt: skip
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = functional_call(model, {n: p - g[n] for n, p in own.items()}, (x,))
        sq(out.float()).backward()
    for n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32
        top = float(want[n].abs().max())
        torch.testing.assert_close(p.grad1.double(), want[n], rtol=0.05, atol=0.05 * top)


# -- conversions that swap the parameters (swap_tensors) -----------------------------------------


@pytest.fixture
def swapping():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


CONVERSIONS = {
    ".double()": lambda m: m.double(),
    ".to(float64)": lambda m: m.to(torch.float64),
    ".half().double()": lambda m: m.half().double(),
    ".float() of float32": lambda m: m.float(),  # (swapped too, same dtype and memory)
    ".cpu()": lambda m: m.cpu(),
}


@pytest.mark.parametrize("swap", [True, False], ids=["swap_tensors", "set .data"])
@pytest.mark.parametrize("convert", list(CONVERSIONS), ids=list(CONVERSIONS))
def test_conversion_after_add_hooks(convert, swap):
    """With torch.__future__.set_swap_module_params_on_conversion(True), a conversion puts
    another tensor under each parameter's Python object (torch.utils.swap_tensors), which
    loses the gradient hooks registered on it: before, grad1 was silently left out (the
    backward looked like one for the inputs only). The parameters the user holds get grad1."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        held = list(model.parameters())
        with gradhooks.add_hooks(model, loss_reduction="sum") as h:
            CONVERSIONS[convert](model)
            x = x_of().to(held[0].dtype)
            for _ in range(2):  # (and again, hooked as they are now)
                h.clear()
                sq(model(x)).backward()
                assert [p is q for p, q in zip(model.parameters(), held)] == [True] * 4
                want = loop_grad(model, sq, x)
                assert_grad1(model, want, convert)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_swapped_parameter_hooks_are_added_again_once(swapping):
    """After the swap the parameter is hooked again (a backward hook the user adds after the
    swap fires too), and its gradient is counted once."""
    model = mlp().float()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.double()
        x = x_of()
        sq(model(x)).backward()
        fired = []
        model[0].weight.register_hook(fired.append)
        gradhooks.hooks_of(model).clear()
        model.zero_grad()
        sq(model(x)).backward()
    assert fired, "a hook added after the swap never fired"
    assert_close(fired[-1], model[0].weight.grad, "the hook's gradient")
    want = loop_grad(model, sq, x)
    assert_grad1(model, want, "second step")
    assert_close(model[0].weight.grad1.sum(0), model[0].weight.grad, ".grad")


# -- nested tensors -----------------------------------------------------------------------------


def jagged() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(n, 3, dtype=D, generator=g) for n in (2, 3, 1)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


class Nests(nn.Module):
    """Makes a nested tensor of its dense input inside its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    def forward(self, x):
        nt = torch.nested.as_nested_tensor([x[0, :2], x[1]], layout=torch.jagged)
        return self.lin(nt)


@pytest.mark.parametrize("batch_dim", ["auto", 0, None])
def test_nested_tensor_input_is_refused(batch_dim):
    model = mlp()
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=batch_dim) as h:
        with pytest.raises(
            gradhooks.UnsupportedInputError, match=r"'Sequential' \(the model\).*nested.*to_padded"
        ):
            model(jagged())
        with h.paused():  # (runs, without grad1)
            out = model(jagged())
            assert out.is_nested
        x = x_of()  # the handle goes on as before
        sq(model(x)).backward()
    assert_grad1(model, loop_grad(model, sq, x), "after the refusal")


def test_nested_tensor_made_inside_the_model_is_refused():
    model = Nests()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.UnsupportedInputError, match=r"'lin' \(Linear\).*nested tensor"
        ):
            model(torch.randn(2, 4, 3, dtype=D))


def test_nested_multihead_attention_is_refused():
    mha = nn.MultiheadAttention(3, 1, batch_first=True).double()
    nt = jagged()
    with gradhooks.add_hooks(mha, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.UnsupportedInputError, match=r"'MultiheadAttention' \(the model\).*nested"
        ):
            mha(nt, nt, nt, need_weights=False)


# -- parametrizations in training mode ----------------------------------------------------------

PARAMETRIZATIONS = {
    "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "orthogonal": lambda m: nn.utils.parametrizations.orthogonal(m),
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
}


def per_example_from(model: nn.Module, x: torch.Tensor) -> dict:
    """The float64 loop, each example from a copy of ``model`` as it is now (training mode:
    spectral_norm's power iteration then starts from the same buffers for every example)."""
    rows: dict[str, list] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        one = copy.deepcopy(model)
        sq(one(x[i : i + 1])).backward()
        for n, p in one.named_parameters():
            rows[n].append(p.grad)
    return {n: torch.stack(r) for n, r in rows.items()}


@pytest.mark.parametrize("when", ["before", "after"], ids=["registered before", "after add_hooks"])
@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_parametrization_in_training_mode(kind, when):
    """grad1 of parametrizations.weight.original (original0/original1 for weight_norm) equals
    the loop, and the buffers (spectral_norm's _u and _v, advanced once per forward in
    training) are left as a plain step leaves them: the fallback recomputes the
    parametrization from copies of the buffers as its call found them. Before, spectral_norm
    was refused (its recomputation ran the power iteration again, from the advanced buffers,
    and advanced them once more)."""
    model = mlp()
    if when == "before":
        PARAMETRIZATIONS[kind](model[0])
    model.train()
    x = x_of(5)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        if when == "after":
            PARAMETRIZATIONS[kind](model[0])
        for step in range(2):  # (the buffers advance at each step, as plain training's)
            want = per_example_from(model, x)
            plain = copy.deepcopy(model)
            with h.paused():
                sq(plain(x)).backward()
            h.clear()
            model.zero_grad()
            sq(model(x)).backward()
            assert_grad1(model, want, f"{kind} {when}, step {step}")
            names = {n for n, _ in model.named_parameters()}
            assert {"0.parametrizations.weight.original"} <= names or kind == "weight_norm"
            for (n, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
                assert torch.equal(b, c), f"{kind} {when}: buffer {n} differs from a plain step"
            for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
                assert_close(p.grad, q.grad, f"{kind} {when}: .grad of {n}")


class Counts(nn.Module):
    """No rule: counts its calls in a buffer, and scales by a buffer it updates in place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=D) / 3)
        self.register_buffer("calls", torch.zeros((), dtype=D))
        self.register_buffer("scale", torch.ones(3, dtype=D))

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.scale.mul_(0.5)
        return x @ torch.linalg.matrix_exp(self.w * self.scale)


def test_fallback_module_changing_its_buffers():
    """The fallback recomputes from the buffers as the call found them (not those its forward
    left): grad1 right, and the buffers changed once per forward, as without hooks."""
    torch.manual_seed(0)
    model = Counts()
    x = x_of()
    want = per_example_from(model, x)
    plain = copy.deepcopy(model)
    sq(plain(x)).backward()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "Counts")
    assert float(model.calls) == 1.0
    for (n, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b, c), f"buffer {n} differs from a plain step"


# -- torch.compile ------------------------------------------------------------------------------


class Positions(nn.Module):
    """A position embedding looked up with arange and broadcast into the batch: its grad1
    comes from the forward's tracker, which must follow the batch under torch.compile too."""

    def __init__(self):
        super().__init__()
        self.pos, self.lin = nn.Embedding(6, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x + self.pos(torch.arange(x.shape[1])))


MODELS = {
    "mlp": (mlp, x_of),
    "positions": (
        lambda: (torch.manual_seed(0), Positions().double())[1],
        lambda: torch.randn(4, 6, 3, dtype=D, generator=torch.Generator().manual_seed(1)),
    ),
}


@pytest.mark.parametrize(
    "kind",
    ["mlp", pytest.param("positions", marks=pytest.mark.slow)],  # (8-15 s each here)
)
@pytest.mark.parametrize("order", ["add_hooks, then compile", "compile, then add_hooks"])
def test_torch_compile(dynamo, order, kind):
    """The default backend: the hooks run eagerly (graph breaks) and grad1 equals the loop,
    at the first call and with the compiled code reused; add_hooks on the OptimizedModule
    torch.compile returns works the same."""
    model, x = MODELS[kind][0](), MODELS[kind][1]()
    want = loop_grad(model, sq, x)
    if order.startswith("add_hooks"):
        h = gradhooks.add_hooks(model, loss_reduction="sum")
        compiled = torch.compile(model)
    else:
        compiled = torch.compile(model)
        h = gradhooks.add_hooks(compiled, loss_reduction="sum")
    with h:
        for step in range(2):
            h.clear()
            sq(compiled(x)).backward()
            assert_grad1(model, want, f"{order}, step {step}")


def test_torch_compile_fullgraph_is_refused(dynamo):
    model = mlp()
    x = x_of()
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        compiled = torch.compile(model, fullgraph=True)
        with pytest.raises(RuntimeError, match=r"gradhooks.*fullgraph=True.*without fullgraph"):
            compiled(x)
        h.clear()
        sq(model(x)).backward()  # (the model, eager, as before)
    assert_grad1(model, loop_grad(model, sq, x), "eager after the refusal")


def test_a_model_compiled_before_add_hooks_gets_no_grad1_and_a_warning_naming_compile(
    dynamo, monkeypatch
):
    """Code compiled before the hooks were added does not call them (dynamo does not guard on
    module hooks by default): no grad1, and the warning names torch.compile and what to do."""
    monkeypatch.setattr(dynamo.config, "skip_nnmodule_hook_guards", True)  # (torch's default)
    model = mlp()
    x = x_of()
    compiled = torch.compile(model, backend="eager")
    sq(compiled(x)).backward()
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.warns(
            gradhooks.GradhooksWarning, match=r"torch\.compile.*compile after add_hooks"
        ):
            sq(compiled(x)).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


_FRESH = """
import sys, torch
from torch import nn
import gradhooks
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
x = torch.randn(4, 3, dtype=torch.float64)
want = gradhooks.oracle.loop_grad(model, lambda o: 0.5 * o.pow(2).sum(), x)
h = gradhooks.add_hooks(model, loss_reduction="sum")
assert "torch._dynamo" not in sys.modules  # (the hooks made before torch.compile loads it)
torch.export.export(model, (x,), strict=False)  # (runs the hooks for real: no refusal)
try:
    torch.compile(model, fullgraph=True)(x)
    raise SystemExit("fullgraph=True was not refused")
except RuntimeError as e:
    assert "fullgraph=True" in str(e) and "gradhooks" in str(e), str(e)
for step in range(2):
    h.clear()
    (0.5 * torch.compile(model)(x).pow(2).sum()).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad1, want[n], rtol=1e-7, atol=1e-9), n
from torch._dynamo.utils import counters
# (the hooks ran for real in frames dynamo compiles, and turned it off: gradhooks' own code
# is never compiled)
assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
print("ok")
"""


# The environment the tests started in, for the fresh interpreter below: what libraries set
# while the suite runs (a compiler that is gcc for C++ as well, which then links no C++
# library into a compiled kernel) is no user's shell
_STARTING_ENVIRONMENT = dict(os.environ)


@pytest.mark.slow  # (a fresh interpreter: importing torch and compiling, ~20-40 s)
def test_torch_compile_of_hooks_made_before_torch_compile_loads(tmp_path):
    """A fresh interpreter, where torch.compile's own modules load after add_hooks: the same
    refusal of fullgraph=True, and grad1 right without it, dynamo compiling no graph of
    gradhooks' code; a non-strict torch.export (which runs the hooks for real) is not
    refused."""
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text(_FRESH)
    root = os.path.dirname(os.path.dirname(gradhooks.__file__))
    start = _STARTING_ENVIRONMENT
    env = {**start, "PYTHONPATH": root + os.pathsep + start.get("PYTHONPATH", "")}
    # (a cache of compiled kernels of its own: one another process wrote half-way is no test)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm"])
def test_parametrization_under_bf16_autocast(kind):
    """Linear on 2-D inputs under bfloat16 autocast, in training mode: grad1 (float32) against
    the float64 loop to bfloat16's precision (8 bits of mantissa: 5% of the largest entry), and
    the buffers as a plain step under autocast leaves them."""
    model = mlp().float()
    PARAMETRIZATIONS[kind](model[0])
    model.train()
    x = x_of(5).float()
    want = per_example_from(copy.deepcopy(model).double(), x.double())
    plain = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = plain(x)
    sq(out.float()).backward()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        sq(out.float()).backward()
    for n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32, n
        top = float(want[n].abs().max())
        torch.testing.assert_close(p.grad1.double(), want[n], rtol=0.05, atol=0.05 * top)
    for (n, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b, c), f"buffer {n} differs from a plain step"

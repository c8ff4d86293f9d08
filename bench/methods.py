"""The methods the benchmark times: plain training, the floor, the peers and gradhooks.

A method turns a :class:`Setup` (its own copy of the model, the batch, the loss) into a
:class:`Runner`: ``reset()`` frees the previous step's results (not timed), ``step()`` is what is
timed, ``result()`` gives what the step computed for the correctness check. A method that cannot
run raises :class:`Unavailable` (peer not installed: ``missing``; peer refuses the model:
``unsupported``); any other exception while setting up or on the first step is reported as
``unsupported`` too, with its message, never a crash.

Adding a method is a function ``setup -> Runner`` and one line in :data:`METHODS`.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import gradhooks
from gradhooks.oracle import loop_grad

from .problems import PER_EXAMPLE, Unavailable


@dataclass
class Setup:
    model: nn.Module  # this method's own copy (hooks and wrappers stay on it)
    x: Tensor
    y: Tensor
    loss: Callable[[Tensor, Tensor], Tensor]

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


@dataclass
class Runner:
    step: Callable[[], None]
    result: Callable[[], dict[str, Tensor] | Tensor | None]  # grad1 dict, norms [batch], None
    reset: Callable[[], None] = lambda: None
    # bytes the method holds between steps (the floor's buffer, gradhooks' grad1): added to
    # the step's peak memory
    held_bytes: Callable[[], int] = lambda: 0
    # what the method says of its last step, for the report (gradhooks: its norms' forms)
    notes: Callable[[], str] = lambda: ""


@dataclass(frozen=True)
class Method:
    name: str  # command-line name
    label: str  # column header
    # "grad" (plain), "grad1", "norms", "step" (a DP-SGD step), "jacobian", "sum_grad_sq",
    # "kfac" (the gradient and K-FAC factors)
    quantity: str
    make: Callable[[Setup], Runner]
    peer: str | None = None  # the package it needs
    slow: bool = False  # timed with --slow-reps repetitions
    tags: tuple[str, ...] = field(default=())
    base: str = "plain"  # the method its time is a ratio to in the tables


def _clear(params, *attrs: str) -> None:
    for p in params:
        p.grad = None
        for a in attrs:
            if hasattr(p, a):
                setattr(p, a, None)


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Unavailable("missing", f"{module} is not installed (pip install -e '.[bench]')")


# -- plain training and the floor ----------------------------------------------------------------


def plain(s: Setup) -> Runner:
    params = list(s.trainable().values())

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()

    return Runner(step, lambda: None, reset=lambda: _clear(params))


def plain_sgd(s: Setup) -> Runner:
    """A plain training step: forward, backward and an SGD update (what the DP steps do on top
    of their clipping and noise)."""
    params = list(s.trainable().values())
    opt = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()
        opt.step()

    return Runner(step, lambda: None, reset=lambda: _clear(params))


def floor(s: Setup) -> Runner:
    """Plain forward+backward plus writing batch x parameters floats once, into a buffer
    allocated beforehand: no method that returns per-example gradients can do less."""
    params = list(s.trainable().values())
    numel = sum(p.numel() for p in params)
    buffer = torch.empty(s.batch * numel, device=s.x.device)

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()
        buffer.fill_(1.0)

    return Runner(
        step, lambda: None, reset=lambda: _clear(params),
        held_bytes=lambda: buffer.numel() * buffer.element_size(),
    )  # fmt: skip


# -- references: loop and vmap(grad) -------------------------------------------------------------


def loop(s: Setup) -> Runner:
    out: dict = {}

    def step() -> None:
        out["g"] = loop_grad(s.model, s.loss, s.x, s.y)

    return Runner(step, lambda: out["g"], reset=out.clear)


def vmap_grad(s: Setup) -> Runner:
    """``torch.func`` ``vmap(grad)``, the vmapped function built once (outside the timing)."""
    params = {n: p.detach() for n, p in s.trainable().items()}
    model, loss = s.model, s.loss

    def one_loss(params, x, y):
        return loss(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))
    out: dict = {}

    def step() -> None:
        out["g"] = per_example(params, s.x, s.y)

    return Runner(step, lambda: out["g"], reset=out.clear)


# -- peers ---------------------------------------------------------------------------------------


def _opacus(s: Setup, ghost: bool) -> Runner:
    _need("opacus")
    if hasattr(s.model, "expand_positions"):
        s.model.expand_positions = True  # (the position_ids workaround Opacus needs)
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping

    if ghost:
        wrapped = GradSampleModuleFastGradientClipping(
            s.model, loss_reduction="mean", use_ghost_clipping=True
        )
    else:
        wrapped = GradSampleModule(s.model, loss_reduction="mean")
    named = s.trainable()
    params = list(named.values())
    out: dict = {}

    def step() -> None:
        s.loss(wrapped(s.x), s.y).backward()
        if ghost:
            out["norms"] = wrapped.get_norm_sample()

    def result():
        if ghost:
            return out["norms"]
        return {n: p.grad_sample for n, p in named.items()}

    def reset() -> None:
        _clear(params, "grad_sample", "_norm_sample")
        out.clear()

    return Runner(step, result, reset=reset)


def _backpack(s: Setup, norms: bool) -> Runner:
    _need("backpack")
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad, BatchL2Grad

    model = extend(s.model)
    named = s.trainable()
    params = list(named.values())
    batch = s.batch  # BackPACK's per-example terms of a mean loss carry 1/batch: undone below

    def step() -> None:
        with backpack(BatchL2Grad() if norms else BatchGrad()):
            s.loss(model(s.x), s.y).backward()

    def result():
        attr = "batch_l2" if norms else "grad_batch"
        lacking = [n for n, p in named.items() if getattr(p, attr, None) is None]
        if lacking:
            raise Unavailable(
                "unsupported", f"no {attr} for {len(lacking)} parameters ({', '.join(lacking)})"
            )
        if norms:
            return sum(p.batch_l2 for p in params).sqrt() * batch
        return {n: p.grad_batch * batch for n, p in named.items()}

    return Runner(step, result, reset=lambda: _clear(params, "grad_batch", "batch_l2"))


def expanded_weights(s: Setup) -> Runner:
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    named = s.trainable()
    params = list(named.values())
    call = call_for_per_sample_grads(s.model, loss_reduction="mean")

    def step() -> None:
        s.loss(call(s.x), s.y).backward()

    def result():
        return {n: p.grad_sample for n, p in named.items()}

    return Runner(step, result, reset=lambda: _clear(params, "grad_sample"))


# -- gradhooks -----------------------------------------------------------------------------------


def _hooks(s: Setup) -> gradhooks.Hooks:
    try:
        return gradhooks.add_hooks(s.model, loss_reduction="mean")
    except TypeError as e:  # no rule for some layer (yet)
        raise Unavailable("unsupported", str(e).splitlines()[1].strip()) from e


def gradhooks_grad1(s: Setup) -> Runner:
    """As a training loop uses it: ``grad1`` stays on the parameters between steps (and its
    memory is reused by the next backward); those bytes are counted as held."""
    hooks = _hooks(s)
    named = s.trainable()

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()

    def reset() -> None:
        hooks.clear()
        _clear(named.values())

    def held() -> int:
        return sum(p.grad1.nbytes for p in named.values() if getattr(p, "grad1", None) is not None)

    return Runner(
        step, lambda: {n: p.grad1 for n, p in named.items()}, reset=reset, held_bytes=held
    )


def _gradhooks_quantity(s: Setup, quantity: str, result: str) -> Runner:
    """``add_hooks(quantities=(quantity,))``, which never forms grad1; ``result``: the handle's
    method that gives it."""
    try:
        hooks = gradhooks.add_hooks(s.model, quantities=(quantity,))
    except TypeError as e:
        raise Unavailable("unsupported", str(e).splitlines()[1].strip()) from e
    params = list(s.trainable().values())

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()

    def reset() -> None:
        hooks.clear()
        _clear(params)

    notes = (lambda: forms_chosen(hooks)) if quantity == "norms" else (lambda: "")
    return Runner(step, getattr(hooks, result), reset=reset, notes=notes)


def forms_chosen(hooks) -> str:
    """The forms gradhooks' cost model chose for the per-example norms of the last backward
    (``Hooks.norm_forms``): how many parameters took each, and which were materialized (the
    layers over several positions where the Gram form would cost more)."""
    forms = hooks.norm_forms()
    counts: dict[str, int] = {}
    for form in forms.values():
        counts[form] = counts.get(form, 0) + 1
    text = "norm forms: " + ", ".join(f"{form} {n}" for form, n in sorted(counts.items()))
    materialized = [n for n, f in forms.items() if f == "materialized"]
    if materialized:
        text += f" (materialized: {', '.join(materialized)})"
    return text


def gradhooks_norms(s: Setup) -> Runner:
    """Per-example gradient norms without forming grad1 (``quantities=("norms",)``)."""
    return _gradhooks_quantity(s, "norms", "norms")


# -- DP-SGD steps: per-example clipping to C = 1, Gaussian noise (sigma = 1), an SGD update ---------

MAX_NORM, NOISE = 1.0, 1.0


def _per_example_loss(s: Setup):
    try:
        return PER_EXAMPLE[s.loss]
    except KeyError:
        raise Unavailable("unsupported", "no per-example form of this loss") from None


def _gradhooks_dp(s: Setup, quantity: str, method: str, compile: bool = False) -> Runner:
    each = _per_example_loss(s)
    hooks = gradhooks.add_hooks(s.model, quantities=(quantity,))
    model = _compiled(s) if compile else s.model
    params = list(s.trainable().values())
    opt = torch.optim.SGD(params, lr=1e-3)
    gen = torch.Generator(device=s.x.device).manual_seed(0)

    def step() -> None:
        losses = each(model(s.x), s.y)
        gradhooks.dp_sgd_step(
            hooks, losses, max_norm=MAX_NORM, noise_multiplier=NOISE, generator=gen,
            method=method,
        )  # fmt: skip
        opt.step()

    def reset() -> None:
        hooks.clear()
        gradhooks.clear_grad1(s.model)
        _clear(params)

    return Runner(step, lambda: None, reset=reset)


class _Criterion(nn.Module):
    """A problem's loss as the ``nn.Module`` with ``reduction`` that Opacus' ghost clipping
    wants (``"none"`` gives the per-example losses)."""

    def __init__(self, loss, each) -> None:
        super().__init__()
        self.loss, self.each, self.reduction = loss, each, "mean"

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        losses = self.each(out, y)
        return losses if self.reduction == "none" else losses.mean()


def _opacus_dp(s: Setup, ghost: bool) -> Runner:
    _need("opacus")
    if hasattr(s.model, "expand_positions"):
        s.model.expand_positions = True  # (the position_ids workaround Opacus needs)
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    each = _per_example_loss(s)
    params = list(s.trainable().values())
    kwargs = dict(noise_multiplier=NOISE, max_grad_norm=MAX_NORM, expected_batch_size=s.batch)
    if ghost:
        wrapped = GradSampleModuleFastGradientClipping(
            s.model, loss_reduction="mean", use_ghost_clipping=True
        )
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(params, lr=1e-3), **kwargs)
        criterion = DPLossFastGradientClipping(wrapped, opt, _Criterion(s.loss, each), "mean")
    else:
        wrapped = GradSampleModule(s.model, loss_reduction="mean")
        opt = DPOptimizer(torch.optim.SGD(params, lr=1e-3), **kwargs)
        criterion = s.loss

    def step() -> None:
        criterion(wrapped(s.x), s.y).backward()
        opt.step()

    def reset() -> None:
        opt.zero_grad(set_to_none=True)
        _clear(params, "grad_sample", "_norm_sample")

    return Runner(step, lambda: None, reset=reset)


# -- on torch.compile(model): the default backend and mode, not fullgraph (which gradhooks refuses:
# its hooks run eagerly, each hooked layer's call a graph break) -------------------------------------


_COMPILED_BATCH: list = [None]  # (a weak reference to the batch of the model being compiled)
WARM_COMPILED = 10  # untimed steps of a compiled method before its warm-up step


def _compiled(s: Setup):
    """``torch.compile(s.model)``, dynamo's state started afresh at each model of a run (its
    compiled code and its recompile counts: a model's compiled methods meet dynamo's limits as
    in a process of their own), and guarding on the modules' hooks (by default it does not,
    and the hooked copy of a model would reuse the code compiled for the plain copy, the hooks
    never called: gradhooks warns that it captured nothing)."""
    import weakref

    import torch._dynamo

    if _COMPILED_BATCH[0] is None or _COMPILED_BATCH[0]() is not s.x:
        torch._dynamo.reset()
        _COMPILED_BATCH[0] = weakref.ref(s.x)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    return torch.compile(s.model)


def graph_break_kind(reason: str) -> str:
    """One of dynamo's graph-break reasons, shortened to what broke the graph and where (the
    function it would not trace)."""
    text = " ".join(reason.split())
    head, _, rest = text.partition(" Explanation:")
    where = re.search(r"function `([^`]+)`|builtin `([^`]+)`|built-in function (\w+)>", rest)
    name = next((g for g in where.groups() if g), "") if where else ""
    name = re.sub(r"^<function (\S+) at 0x[0-9a-f]+>$", r"\1", name)
    name = re.sub(r"pybind11_detail\w*\.", "", name).rstrip(".")
    return f"{head.rstrip('.')} ({name})" if name else head.rstrip(".")


def _graph_breaks(run: Callable[[], Runner]) -> Runner:
    """``run()``'s runner, stepped :data:`WARM_COMPILED` times (untimed: dynamo compiles again
    at some of the first steps), whose notes say how many graphs torch.compile made in those
    steps and why it broke the forward between them (dynamo's counters)."""
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    runner = run()
    for _ in range(WARM_COMPILED):  # (past the recompilations of its first steps)
        runner.reset()
        runner.step()
    runner.reset()

    def notes() -> str:
        kinds: dict[str, int] = {}
        for reason, n in counters["graph_break"].items():
            if n > before.get(reason, 0):
                kind = graph_break_kind(reason)
                kinds[kind] = kinds.get(kind, 0) + n - before.get(reason, 0)
        made = counters["stats"]["unique_graphs"] - graphs
        text = f"{made} graphs compiled, {sum(kinds.values())} graph breaks in its first "
        text += f"{WARM_COMPILED + 1} steps (code an earlier method compiled is reused)"
        if kinds:
            worst = sorted(kinds.items(), key=lambda kv: -kv[1])
            text += ": " + "; ".join(f"{n}x {kind}" for kind, n in worst[:5])
        return text

    runner.notes = notes
    return runner


def compiled_plain(s: Setup) -> Runner:
    params = list(s.trainable().values())
    compiled = _compiled(s)

    def step() -> None:
        s.loss(compiled(s.x), s.y).backward()

    return _graph_breaks(lambda: Runner(step, lambda: None, reset=lambda: _clear(params)))


def compiled_grad1(s: Setup) -> Runner:
    """:func:`gradhooks_grad1` on ``torch.compile(model)`` (hooks added first)."""

    def make() -> Runner:
        runner = gradhooks_grad1(s)
        compiled = _compiled(s)
        runner.step = lambda: s.loss(compiled(s.x), s.y).backward()
        return runner

    return _graph_breaks(make)


def compiled_dp(s: Setup) -> Runner:
    """The book-keeping DP step on ``torch.compile(model)`` (hooks added first)."""
    return _graph_breaks(lambda: _gradhooks_dp(s, "norms", "bookkeeping", compile=True))


# -- sum of squared per-example gradients (the diagonal empirical Fisher, gradient variance) ----


def _squared_sums(runner: Runner) -> Runner:
    """A per-example-gradient method's runner followed by ``Σ_i grad1[i]²`` per parameter (how
    a method without a squared-sum quantity of its own gets it)."""
    out: dict = {}

    def step() -> None:
        runner.step()
        out["sq"] = {n: g.square().sum(0) for n, g in runner.result().items()}

    def reset() -> None:
        runner.reset()
        out.clear()

    return Runner(step, lambda: out["sq"], reset=reset, held_bytes=runner.held_bytes)


def _backpack_sum_grad_sq(s: Setup) -> Runner:
    _need("backpack")
    from backpack import backpack, extend
    from backpack.extensions import SumGradSquared

    model = extend(s.model)
    named = s.trainable()
    params = list(named.values())
    square = s.batch**2  # a mean loss's per-example terms carry 1/batch: undone below

    def step() -> None:
        with backpack(SumGradSquared()):
            s.loss(model(s.x), s.y).backward()

    def result():
        lacking = [n for n, p in named.items() if getattr(p, "sum_grad_squared", None) is None]
        if lacking:
            raise Unavailable(
                "unsupported",
                f"no sum_grad_squared for {len(lacking)} parameters ({', '.join(lacking)})",
            )
        return {n: p.sum_grad_squared * square for n, p in named.items()}

    return Runner(step, result, reset=lambda: _clear(params, "sum_grad_squared"))


def gradhooks_sum_grad_sq(s: Setup) -> Runner:
    """``quantities=("sum_grad_sq",)``: ``Σ_i grad1[i]²`` without forming grad1."""
    return _gradhooks_quantity(s, "sum_grad_sq", "sum_grad_sq")


# -- K-FAC: the gradient and the Kronecker factors of every weight, as a K-FAC step needs ---------


def _gradhooks_kfac(s: Setup, fisher: str) -> Runner:
    """The loss's gradient (one forward and backward), then :func:`gradhooks.kfac`: its own
    forward and the backward(s) that feed ``G``: one of a sampled label (``"mc"``; per
    position for a language model), one per class (``"exact"``, the GGN; classifiers only)."""
    if fisher == "exact":
        _classifier(s)
    params = list(s.trainable().values())
    gen = torch.Generator(device=s.x.device).manual_seed(0)
    out: dict = {}

    def step() -> None:
        s.loss(s.model(s.x), s.y).backward()
        out["f"] = gradhooks.kfac(s.model, s.x, fisher=fisher, generator=gen)

    def reset() -> None:
        _clear(params)
        out.clear()

    return Runner(step, lambda: None, reset=reset)


def _sequential(s: Setup) -> nn.Sequential:
    """The model as the ``nn.Sequential`` of modules that BackPACK's second-order extensions
    need (they refuse other containers and cannot see functional calls), sharing its
    parameters and computing the same function (checked on the batch)."""
    from gradhooks import models

    m = s.model
    if isinstance(m, nn.Sequential):
        return m
    if isinstance(m, models.CifarCNN):
        seq = nn.Sequential(*m.features, nn.Flatten(), m.head)
    elif isinstance(m, models.SimpleCNN):
        seq = nn.Sequential(
            m.conv1, nn.ReLU(), m.conv2, nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), m.fc1,
            nn.ReLU(), m.fc2,
        )  # fmt: skip
    else:
        raise Unavailable(
            "unsupported", f"needs an nn.Sequential of supported modules ({type(m).__name__})"
        )
    with torch.no_grad():
        if not torch.allclose(seq(s.x), m(s.x), rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"the nn.Sequential form of {type(m).__name__} differs from it")
    return seq


def _backpack_kfac(s: Setup, exact: bool) -> Runner:
    """BackPACK's ``KFLR`` (``exact``, the GGN) or ``KFAC`` (one sampled label): one backward
    gives the gradient and the factors. ``result()``, for ``KFLR``: ``{weight: (G, A)}`` of the
    Linear layers, whose factors BackPACK defines as gradhooks does (its convolutions' are
    scaled differently), for the check against gradhooks' exact factors."""
    _classifier(s)
    _need("backpack")
    from backpack import backpack, extend
    from backpack.extensions import KFAC, KFLR

    model = extend(_sequential(s))
    loss = extend(nn.CrossEntropyLoss())
    named = s.trainable()
    params = list(named.values())
    attr = "kflr" if exact else "kfac"
    name_of = {id(p): n for n, p in named.items()}  # (the model's own names)
    linear = {name_of[id(m.weight)]: m for m in model.modules() if isinstance(m, nn.Linear)}

    def step() -> None:
        with backpack(KFLR() if exact else KFAC(mc_samples=1)):
            loss(model(s.x), s.y).backward()

    def result():
        lacking = [n for n, p in named.items() if getattr(p, attr, None) is None]
        if lacking:
            raise Unavailable(
                "unsupported", f"no {attr} for {len(lacking)} parameters ({', '.join(lacking)})"
            )
        if not exact:
            return None
        return {n: tuple(getattr(m.weight, attr)) for n, m in linear.items()}

    return Runner(step, result, reset=lambda: _clear(params, attr))


# -- per-example Jacobians of every output (classifiers: [batch, classes] outputs) ---------------


def _classifier(s: Setup) -> None:
    if s.loss.__name__ != "classify":
        raise Unavailable("unsupported", "benchmarked on [batch, classes] outputs only")


def gradhooks_jacobians(s: Setup) -> Runner:
    _classifier(s)
    out: dict = {}

    def step() -> None:
        out["j"] = gradhooks.jacobians(s.model, s.x, flatten=True)

    return Runner(step, lambda: None, reset=out.clear)


def vmap_jacrev(s: Setup) -> Runner:
    """The Q&A's recipe: ``vmap`` over examples of ``jacrev`` of ``functional_call``, flattened
    to ``[batch, outputs, P]`` (the function built once)."""
    _classifier(s)
    params = {n: p.detach() for n, p in s.trainable().items()}
    buffers = {n: b.detach() for n, b in s.model.named_buffers()}
    model = s.model

    def one(x):
        call = lambda p: functional_call(model, (p, buffers), (x.unsqueeze(0),))[0]
        return torch.cat([v.flatten(1) for v in torch.func.jacrev(call)(params).values()], -1)

    per_example = vmap(one)
    out: dict = {}

    def step() -> None:
        out["j"] = per_example(s.x)

    return Runner(step, lambda: None, reset=out.clear)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("plain", "plain fwd+bwd", "grad", plain),
        Method("plain-sgd", "plain step (SGD)", "step", plain_sgd),
        Method("floor", "floor", "grad", floor),
        Method("loop", "loop", "grad1", loop, slow=True),
        Method("vmap", "vmap(grad)", "grad1", vmap_grad),
        Method("opacus", "Opacus hooks", "grad1", lambda s: _opacus(s, ghost=False), "opacus"),
        Method("backpack", "BackPACK BatchGrad", "grad1", lambda s: _backpack(s, False), "backpack"),
        Method("ew", "ExpandedWeights", "grad1", expanded_weights),
        Method("grad1", "gradhooks grad1", "grad1", gradhooks_grad1, tags=("gradhooks",)),
        Method("opacus-ghost", "Opacus ghost norms", "norms", lambda s: _opacus(s, ghost=True), "opacus"),
        Method("backpack-l2", "BackPACK BatchL2Grad", "norms", lambda s: _backpack(s, True), "backpack"),
        Method("norms", "gradhooks norms", "norms", gradhooks_norms, tags=("gradhooks",)),
        Method("opacus-dp", "Opacus DP step (hooks)", "step", lambda s: _opacus_dp(s, ghost=False), "opacus"),
        Method("opacus-dp-ghost", "Opacus DP step (ghost)", "step", lambda s: _opacus_dp(s, ghost=True), "opacus"),
        Method("dp", "gradhooks DP step (ghost)", "step", lambda s: _gradhooks_dp(s, "norms", "ghost"), tags=("gradhooks",)),
        Method("dp-bk", "gradhooks DP step (book-keeping)", "step", lambda s: _gradhooks_dp(s, "norms", "bookkeeping"), tags=("gradhooks",)),
        Method("dp-grad1", "gradhooks DP step (grad1)", "step", lambda s: _gradhooks_dp(s, "grad1", "grad1"), tags=("gradhooks",)),
        Method("vmap-sgs", "vmap(grad) squared sums", "sum_grad_sq", lambda s: _squared_sums(vmap_grad(s))),
        Method("opacus-sgs", "Opacus hooks squared sums", "sum_grad_sq", lambda s: _squared_sums(_opacus(s, ghost=False)), "opacus"),
        Method("ew-sgs", "ExpandedWeights squared sums", "sum_grad_sq", lambda s: _squared_sums(expanded_weights(s))),
        Method("backpack-sgs", "BackPACK SumGradSquared", "sum_grad_sq", _backpack_sum_grad_sq, "backpack"),
        Method("sgs", "gradhooks sum_grad_sq", "sum_grad_sq", gradhooks_sum_grad_sq, tags=("gradhooks",)),
        Method("backpack-kflr", "BackPACK KFLR (exact)", "kfac", lambda s: _backpack_kfac(s, True), "backpack"),
        Method("kfac", "gradhooks K-FAC (exact)", "kfac", lambda s: _gradhooks_kfac(s, "exact"), tags=("gradhooks",)),
        Method("backpack-kfac", "BackPACK KFAC (MC)", "kfac", lambda s: _backpack_kfac(s, False), "backpack"),
        Method("kfac-mc", "gradhooks K-FAC (MC)", "kfac", lambda s: _gradhooks_kfac(s, "mc"), tags=("gradhooks",)),
        Method("compile-plain", "compiled: plain fwd+bwd", "grad", compiled_plain),
        Method("compile-grad1", "compiled: gradhooks grad1 (/ compiled plain)", "grad1", compiled_grad1, tags=("gradhooks",), base="compile-plain"),
        Method("compile-dp", "compiled: gradhooks DP step (/ compiled plain)", "step", compiled_dp, tags=("gradhooks",), base="compile-plain"),
        Method("jacrev", "vmap(jacrev)", "jacobian", vmap_jacrev, slow=True),
        Method("jacobians", "gradhooks Jacobians", "jacobian", gradhooks_jacobians, slow=True, tags=("gradhooks",)),
    ]
}  # fmt: skip

COMPILED = "compile-plain,compile-grad1,compile-dp"  # with --compile only

PEERS = ("vmap", "opacus", "backpack", "ew")  # the grad1 peers gradhooks is compared with

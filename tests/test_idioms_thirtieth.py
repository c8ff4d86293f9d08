"""Training-loop idioms, a thirtieth set: habits of GPU training scripts around compilation,
weights swapped for a call, gradients kept or rescaled outside the optimizer, and parameters a
step does not reach.

Each test runs several steps of an ordinary loop (``zero_grad``, a forward, a backward, an
optimizer's step) with one habit: blocks compiled one by one (``block.compile()``, before or
after ``add_hooks``); a block kept out of a compiled model by ``torch.compiler.disable``
(the eager and the AOTAutograd backends, under bfloat16 autocast too); a model compiled by
AOTAutograd into the DP step; a compiled function that zeroes, runs the forward and the
backward, clips and steps; a compiled model with a weight-norm parametrization, or with a
checkpointed block; several weight-noise samples in one loss, each a
``torch.func.functional_call`` of the model with ``p + noise`` in its slots; an ensemble of
``stack_module_state`` weights run member by member through one skeleton; every ``.grad`` a
view of one flat buffer zeroed in place (a contiguous gradient buffer), over micro-batches
too; a layer-wise trust ratio put on ``.grad`` by ``register_post_accumulate_grad_hook``; one
parameter's ``.grad = None`` between two micro-batches; batch norms kept in eval by a
``train()`` override (``norm_eval``) into the DP step; BitFit's biases alone, then the
whole model unfrozen into the optimizer by ``add_param_group``; an early-exit network whose
exits a step picks; two optimizers stepped at different accumulation periods; one float16
``GradScaler`` over two optimizers, one of them unscaled and clipped;
``scaled_dot_product_attention`` under ``sdpa_kernel(MATH)``; ``orthogonal`` with its
Cayley and Householder maps, with and without trivialization, inside a checkpoint, and
cached; a hooked model in ``nn.DataParallel`` on the CPU; an embedding renormalized in its
forward by ``max_norm``; a batch made under ``inference_mode``; a validation with
``requires_grad_(False)`` on the whole model; the model rounded through bfloat16 for an
evaluation and cast back; the even and the odd examples run through the model apart.

Every ``grad1`` is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`) of the weights the forward used, exactly in
float64 or within the rounding of the precision the step ran in (``5e-2`` of the largest entry
for bfloat16, ``1e-2`` for float16, as ``docs/mixed-precision.md`` states), divided by the
scale where the loss was scaled; its mean with ``.grad`` (times the factor a hook put on it);
the DP step's ``.grad`` and norms with the clipped mean of those rows.

Found and fixed: a loss over several ``functional_call``\\ s of the model, each given tensors
computed from its parameters (``p + noise``) or from one stacked tensor (``stacked[i]``),
planned the hooks again at each call, and the backward lost the earlier calls' share on its
way to the parameters: refused by the check of the sums (naming weight decay as a likely
cause), or by the DP step, and wrong with ``verify=False``; those calls' shares now go on to
the tensors their weights were made from. The even and the odd examples run through the
model apart (``x[0::2]``, ``x[1::2]``) in one backward had ``grad1`` add them up two by two,
in silence: refused now, as ``x.chunk(2)`` is. And ``check()`` took the zeros a backward gives
a parameter it does not reach after ``zero_grad(set_to_none=False)`` for a ``grad1`` of an
earlier backward. An orthogonal parametrization inside a reentrant checkpoint is refused,
naming the parametrization, where the loop has its gradients: a strict xfail saying why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from test_idioms_eighteenth import clipped, norms_of
from test_idioms_twentyeighth import BF16, FP16, Net, assert_step, batch, ce, loop, near
from torch import nn
from torch.func import functional_call, stack_module_state
from torch.nn.utils.parametrizations import orthogonal, weight_norm
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, one_thread

D = torch.float64
F32 = torch.float32
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def run(model, forward=None, steps: int = 3, bf16: bool = False, live: bool = False) -> None:
    """``steps`` steps of SGD on ``model``, already hooked, through ``forward`` (the model by
    default), under bfloat16 autocast where ``bf16``; every step's ``grad1`` checked."""
    forward = model if forward is None else forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, dtype=F32 if bf16 else D)
        want = loop(model, x, y, live)
        optimizer.zero_grad()
        with autocast(bf16):
            out = forward(x)
        ce(out, y).backward()
        assert_step(model, want, f"step {step}", rel=BF16 if bf16 else 0.0)
        optimizer.step()


def dp_check(h, model, x, y, want: dict, what: str, bound: float = 0.5) -> None:
    """The DP step (no noise) of ``model(x)``: its norms and ``.grad`` against ``want``'s."""
    losses = F.cross_entropy(model(x), y, reduction="none")
    norms = gradhooks.dp_sgd_step(h, losses, max_norm=bound, noise_multiplier=0.0)
    assert_close(norms, norms_of(want), f"{what}: the DP step's norms")
    means = clipped(want, bound)
    for n, p in model.named_parameters():
        if n in means:
            assert_close(p.grad, means[n], f"{what}: the DP step's {n}")


class Blocks(nn.Module):
    """An input layer, three residual Linear-Tanh blocks and a head (4 -> 6 -> 3), seeded."""

    def __init__(self, dtype=D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 3)
        self.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


# -- compiled models and steps ----------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bfloat16 autocast"])
def test_blocks_compiled_one_by_one_after_add_hooks(dynamo, bf16):
    """Regional compilation, as torchtune and Hugging Face do it: each residual block compiled
    in place (``block.compile()``, the eager backend) after ``add_hooks``, the rest of the model
    eager: ``grad1`` at every step is each example's own gradient."""
    model = Blocks(F32 if bf16 else D)
    with gradhooks.add_hooks(model):
        for block in model.blocks:
            block.compile(backend="eager")
        run(model, bf16=bf16)


def test_blocks_compiled_one_by_one_before_add_hooks(dynamo):
    """The blocks compiled in place before ``add_hooks``: the same ``grad1``."""
    model = Blocks()
    for block in model.blocks:
        block.compile(backend="eager")
    with gradhooks.add_hooks(model):
        run(model)


class Disabled(Blocks):
    """``Blocks`` whose middle block runs in a method marked ``torch.compiler.disable``."""

    @torch.compiler.disable
    def middle(self, h):
        return self.blocks[1](h)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + self.blocks[0](h)
        h = h + self.middle(h)
        h = h + self.blocks[2](h)
        return self.head(h)


@pytest.mark.parametrize(
    "backend,bf16", [("eager", False), ("aot_eager", False), ("eager", True)],
    ids=["eager", "aot_eager", "eager under bfloat16"],
)  # fmt: skip
def test_a_block_kept_out_of_the_compiled_model_by_compiler_disable(dynamo, backend, bf16):
    """``torch.compile(model)`` whose middle block runs in a method marked
    ``torch.compiler.disable`` (dynamo leaves it to run eagerly, a graph break on each side):
    ``grad1`` is the loop's at every step, with the eager and the AOTAutograd backends, and
    under bfloat16 autocast."""
    model = Disabled(F32 if bf16 else D)
    with gradhooks.add_hooks(model):
        run(model, torch.compile(model, backend=backend), bf16=bf16)


def test_a_model_compiled_by_aot_autograd_into_the_dp_step(dynamo):
    """``torch.compile(model, backend="aot_eager")`` (AOTAutograd's joint graph, run without
    code generation): each step's ``grad1`` is the loop's, and the DP step of the compiled
    model's forward gives the clipped mean of those rows and their norms."""
    model = Blocks()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(compiled(x), y).backward()
            assert_step(model, want, f"step {step}")
            dp_check(h, compiled, x, y, want, f"step {step}")
            optimizer.step()


def test_a_compiled_function_that_zeroes_steps_and_clips_inside_it(dynamo):
    """One compiled function (the eager backend) holding the whole step: ``zero_grad``, the
    forward, the backward, ``clip_grad_norm_``, a copy of ``grad1`` for the log and the
    optimizer's step. The ``grad1`` it copied is each example's own gradient at the weights
    before the step, and ``.grad`` is their mean clipped."""
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: dict[str, torch.Tensor] = {}
    clipped_grads: dict[str, torch.Tensor] = {}

    @torch.compile(backend="eager")
    def step_of(x, y):
        optimizer.zero_grad()
        loss = ce(model(x), y)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for n, p in model.named_parameters():
            logged[n] = p.grad1.clone()
            clipped_grads[n] = p.grad.clone()
        optimizer.step()
        return total

    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop(model, x, y)
            total = step_of(x, y)
            factor = min(1.0, 0.5 / (total.item() + 1e-6))
            for n in want:
                assert_close(logged[n], want[n], f"step {step}: {n}")
                assert_close(clipped_grads[n], factor * want[n].mean(0), f"step {step}: .grad {n}")


def test_a_compiled_model_with_a_weight_norm_parametrization(dynamo):
    """A block's Linear under ``weight_norm`` (the parametrization: ``original0``, the norm,
    and ``original1``, the direction), the model compiled (the eager backend): every ``grad1``,
    the two originals' too, is the loop's at every step."""
    model = Blocks()
    weight_norm(model.blocks[0][0])
    with gradhooks.add_hooks(model):
        run(model, torch.compile(model, backend="eager"), live=True)


class Checkpointed(Net):
    """``Net`` whose middle layer runs in a checkpoint (reentrant or not); ``orthogonal`` puts
    an orthogonal parametrization on it (its weight then made inside the checkpoint)."""

    def __init__(self, reentrant: bool, orthogonal_weight: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        if orthogonal_weight:
            orthogonal(self.l2)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        h = checkpoint(lambda h: torch.tanh(self.l2(h)), h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_compiled_model_with_a_checkpointed_block(dynamo, reentrant):
    """A model whose middle layer is checkpointed, compiled (the eager backend): ``grad1`` is
    the loop's at every step, the checkpoint reentrant or not."""
    model = Checkpointed(reentrant)
    with gradhooks.add_hooks(model):
        run(model, torch.compile(model, backend="eager"))


# -- weights swapped for a call ----------------------------------------------------------------


class WeightNoise(nn.Module):
    """``net`` run once per noise sample in ``self.noise`` by ``functional_call`` with
    ``p + noise`` in each parameter's slot; the samples' logits stacked, ``[batch, k, 3]``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.net = Net()
        self.k = k
        self.noise: list[dict[str, torch.Tensor]] = []

    def draw(self, step: int) -> None:
        g = torch.Generator().manual_seed(700 + step)
        self.noise = [
            {n: 0.1 * torch.randn(p.shape, generator=g, dtype=D) for n, p in self.net.named_parameters()}
            for _ in range(self.k)
        ]  # fmt: skip

    def forward(self, x):
        outs = []
        for noise in self.noise:
            weights = {n: p + noise[n] for n, p in self.net.named_parameters()}
            outs.append(functional_call(self.net, weights, (x,)))
        return torch.stack(outs, 1)


def over_samples(out, y):
    """The mean over the samples of each one's cross-entropy (``out``: ``[batch, k, 3]``)."""
    k = out.shape[1]
    return F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(k))


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("verify", [True, False], ids=["checked", "verify=False"])
@pytest.mark.parametrize("hooked", ["the network", "a wrapper"])
def test_several_weight_noise_samples_through_functional_call_in_one_loss(k, verify, hooked):
    """Variational weight noise with ``k`` samples per step: the loss is the mean over the
    samples of the network's loss at ``p + noise``, each a ``functional_call`` of the hooked
    network (or of a hooked wrapper's submodule). Each call of the hooked network planned the
    hooks for its own tensors; the backward reached the earlier calls' layers after the later
    calls had planned them out, and their share never reached the parameters: refused by the
    check of the sums, and wrong with ``verify=False``. Now ``grad1`` is each example's own
    gradient of the mean over the samples, at every step."""
    model = WeightNoise(k)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model.net if hooked == "the network" else model, verify=verify):
        for step in range(3):
            model.draw(step)
            x, y = batch(step)
            want = loop_grad(copy.deepcopy(model), over_samples, x, y)
            optimizer.zero_grad()
            over_samples(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()


@pytest.mark.parametrize(
    "how", ["two micro-batches", "both forwarded first", "autograd.grad", "retained graph"]
)
def test_weight_noise_samples_through_functional_call_in_other_backwards(how):
    """Three weight-noise samples per forward, the loss backpropagated otherwise: over two
    micro-batches, both forwarded before their backwards (run in reverse), by
    ``torch.autograd.grad`` assigned to ``.grad``, or twice through a retained graph (the
    second of half the loss). ``grad1`` is the loop's rows as ``.grad`` adds them up: the sum
    of the micro-batches' halves, the one backward's, or 1.5 times it."""
    model = WeightNoise(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = 2 if how in ("two micro-batches", "both forwarded first") else 1
    with gradhooks.add_hooks(model.net):
        for step in range(3):
            optimizer.zero_grad()
            wants, losses = [], []
            for m in range(micro):
                model.draw(10 * step + m)
                x, y = batch(10 * step + m)
                wants.append(loop_grad(copy.deepcopy(model), over_samples, x, y))
                losses.append(over_samples(model(x), y) / micro)
                if how == "two micro-batches":
                    losses.pop().backward()
            want = {n: sum(w[n] for w in wants) / micro for n in wants[0]}
            if how == "both forwarded first":
                for loss in reversed(losses):
                    loss.backward()
            elif how == "autograd.grad":
                params = list(model.parameters())
                for p, g in zip(params, torch.autograd.grad(losses[0], params), strict=True):
                    p.grad = g
            elif how == "retained graph":
                losses[0].backward(retain_graph=True)
                (0.5 * losses[0]).backward()
                want = {n: 1.5 * w for n, w in want.items()}
            assert assert_step(model, want, f"step {step}") == 6
            optimizer.step()


@pytest.mark.parametrize("k", [2, 3])
def test_weight_noise_samples_through_functional_call_into_the_dp_step(k):
    """The weight-noise loss above, each example's the mean over the ``k`` samples, given to
    the DP step (no noise of its own): it clips each example's gradient of that mean over every
    parameter and returns the norms, the loop's, at every step (refused before, as no call
    had written those parameters' rows)."""
    model = WeightNoise(k)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model.net) as h:
        for step in range(3):
            model.draw(step)
            x, y = batch(step)
            want = loop_grad(copy.deepcopy(model), over_samples, x, y)
            optimizer.zero_grad()
            out = model(x)
            losses = F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(k), reduction="none")
            norms = gradhooks.dp_sgd_step(
                h, losses.view(4, k).mean(1), max_norm=0.5, noise_multiplier=0.0
            )
            assert_close(norms, norms_of(want), f"step {step}: the DP step's norms")
            means = clipped(want, 0.5)
            for n, p in model.named_parameters():
                assert_close(p.grad, means[n], f"step {step}: the DP step's {n}")
            optimizer.step()


def test_weight_noise_samples_through_functional_call_under_bfloat16_autocast():
    """Two weight-noise samples in one loss, the network float32 and its forwards under
    bfloat16 autocast: ``grad1`` is each example's own gradient of the mean over the samples
    (the float64 loop's), within bfloat16's rounding, at every step."""
    model = WeightNoise(2).to(F32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model.net):
        for step in range(3):
            model.draw(step)
            reference = copy.deepcopy(model).to(D)
            model.noise = [{n: t.to(F32) for n, t in noise.items()} for noise in model.noise]
            x, y = batch(step, dtype=F32)
            want = loop_grad(reference, over_samples, x.to(D), y)
            optimizer.zero_grad()
            with autocast(True):
                out = model(x)
            over_samples(out.float(), y).backward()
            assert assert_step(model, want, f"step {step}", rel=BF16) == 6
            optimizer.step()


class Alternate(WeightNoise):
    """The even examples through one noise sample, the odd ones through the other
    (``x[0::2]``, ``x[1::2]``), or through the network itself where ``noisy`` is false; the
    logits put back in the batch's order."""

    def __init__(self, noisy: bool) -> None:
        super().__init__(2)
        self.noisy = noisy

    def forward(self, x):
        outs = []
        for j, noise in enumerate(self.noise):
            part = x[j::2]
            if self.noisy:
                weights = {n: p + noise[n] for n, p in self.net.named_parameters()}
                outs.append(functional_call(self.net, weights, (part,)))
            else:
                outs.append(self.net(part))
        return torch.stack(outs, 1).flatten(0, 1)  # (rows 0, 1, 2, 3: even, odd, even, odd)


@pytest.mark.parametrize("step", ["backward", "dp"])
@pytest.mark.parametrize("noisy", [False, True], ids=["the network", "a noise sample each"])
def test_the_even_and_odd_examples_run_apart_in_one_backward_are_refused(noisy, step):
    """The even and the odd examples of the batch run through the hooked network apart
    (``net(x[0::2])``, ``net(x[1::2])``, each through its own weight-noise sample or not), the
    logits put back in order, one backward: row ``i`` of each forward is another example, and
    ``grad1`` held the even and odd examples' gradients added up two by two, in silence (the
    sum over the batch was right). The backward is now refused with a MixedExamplesError,
    as for ``x.chunk(2)``, writing no gradient, and the next step, on the whole batch, is the
    loop's."""
    model = Alternate(noisy)
    with gradhooks.add_hooks(model.net) as h:
        model.draw(0)
        x, y = batch(0)
        with pytest.raises(gradhooks.MixedExamplesError):
            losses = F.cross_entropy(model(x), y, reduction="none")
            if step == "dp":
                gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
            else:
                losses.mean().backward()
        for n, p in model.named_parameters():
            assert p.grad is None and "grad1" not in p.__dict__, n
        x, y = batch(1)
        want = loop(model.net, x, y)
        ce(model.net(x), y).backward()
        assert_step(model.net, want, "the whole batch after")


class Ensemble(nn.Module):
    """Three members' weights stacked (``stack_module_state``) as parameters of the ensemble,
    ``stacked[name][i]`` run through one frozen skeleton by ``functional_call``; the members'
    logits stacked, ``[batch, 3, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        members = []
        for i in range(3):
            member = Net()
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in member.parameters():
                    p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=D))
            members.append(member)
        stacked, _ = stack_module_state(members)
        self.names = list(stacked)
        self.stacked = nn.ParameterList(nn.Parameter(stacked[n].detach()) for n in self.names)
        self.skeleton = Net().requires_grad_(False)

    def forward(self, x):
        outs = []
        for i in range(3):
            weights = {n: t[i] for n, t in zip(self.names, self.stacked, strict=True)}
            outs.append(functional_call(self.skeleton, weights, (x,)))
        return torch.stack(outs, 1)


@pytest.mark.parametrize("hooked", ["the skeleton", "the ensemble"])
def test_an_ensemble_of_stacked_states_run_member_by_member_through_functional_call(hooked):
    """A deep ensemble kept as ``stack_module_state``'s stacked weights, each member run in a
    Python loop (not ``vmap``) through one skeleton by ``functional_call`` with
    ``stacked[name][i]`` in its slots, the loss the mean over the members, the skeleton
    hooked (the stacked weights outside it, as torch.func's ensembling tutorial keeps them)
    or the module holding both: each stacked weight's ``grad1`` is ``[batch, 3, *shape]``,
    each example's own gradient, at every step. (With the skeleton hooked, the second
    member's call planned the first's out, as for weight noise above: refused.)"""
    model = Ensemble()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model.skeleton if hooked == "the skeleton" else model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(copy.deepcopy(model), over_samples, x, y)
            optimizer.zero_grad()
            over_samples(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == 6
            optimizer.step()


# -- gradients kept or rescaled outside the optimizer ------------------------------------------


def flat_grads(model: nn.Module) -> torch.Tensor:
    """One flat buffer of zeros, every parameter's ``.grad`` a view of its slice."""
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    start = 0
    for p in params:
        p.grad = buffer[start : start + p.numel()].view_as(p)
        start += p.numel()
    return buffer


@pytest.mark.parametrize("micro", [1, 2], ids=["one batch", "two micro-batches"])
def test_every_grad_a_view_of_one_flat_buffer_zeroed_in_place(micro):
    """A contiguous gradient buffer (as Apex and DeepSpeed keep one): every ``.grad`` set to a
    view of one flat tensor before training, zeroed by ``buffer.zero_()`` in place of
    ``zero_grad``, autograd adding into the views. ``grad1`` starts afresh at each zeroing and
    adds up over the micro-batches, the loop's at every step; ``.grad`` stays in the buffer."""
    model = Net()
    buffer = flat_grads(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            buffer.zero_()
            wants = []
            for m in range(micro):
                x, y = batch(10 * step + m)
                wants.append(loop(model, x, y))
                (ce(model(x), y) / micro).backward()
            want = {n: sum(w[n] for w in wants) / micro for n in wants[0]}
            assert_step(model, want, f"step {step}")
            for p in model.parameters():
                assert p.grad._base is buffer, "the .grad left the buffer"
            optimizer.step()


def test_a_layer_wise_trust_ratio_put_on_grad_by_a_post_accumulate_grad_hook():
    """LARS's layer-wise trust ratio (``|w| / |g|``, times a coefficient) multiplied into
    ``.grad`` in place by ``register_post_accumulate_grad_hook`` before SGD's step: ``grad1``
    is each example's own gradient, not rescaled (as after ``unscale_`` or a clip), and
    ``.grad`` is its mean times that parameter's ratio."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ratios: dict[int, torch.Tensor] = {}

    def trust(p):
        ratios[id(p)] = 0.01 * (p.detach().norm() / (p.grad.norm() + 1e-12)).clamp(max=10.0)
        p.grad.mul_(ratios[id(p)])

    handles = [p.register_post_accumulate_grad_hook(trust) for p in model.parameters()]
    try:
        with gradhooks.add_hooks(model):
            for step in range(3):
                x, y = batch(step)
                want = loop(model, x, y)
                optimizer.zero_grad()
                ce(model(x), y).backward()
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
                    assert_close(ratios[id(p)] * p.grad1.mean(0), p.grad, f"step {step}: {n}")
                optimizer.step()
    finally:
        for handle in handles:
            handle.remove()


def test_one_parameters_grad_set_to_none_between_two_micro_batches():
    """Two micro-batches per step, the head's weight's ``.grad`` set to ``None`` before the
    second (its first micro-batch's share thrown away): that weight's ``grad1`` holds the
    second micro-batch's rows alone, every other parameter's the sum of both, each the
    loop's and reducing to ``.grad``."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            optimizer.zero_grad()
            wants = []
            for m in range(2):
                x, y = batch(10 * step + m)
                wants.append(loop(model, x, y))
                if m == 1:
                    model.head.weight.grad = None
                (ce(model(x), y) / 2).backward()
            want = {n: (wants[0][n] + wants[1][n]) / 2 for n in wants[0]}
            want["head.weight"] = wants[1]["head.weight"] / 2
            assert_step(model, want, f"step {step}")
            optimizer.step()


def test_two_optimizers_stepped_at_different_accumulation_periods():
    """The head zeroed and stepped at every step, the body at every second step only (its
    gradient accumulated over two batches, at weights that do not move between them): the
    head's ``grad1`` is each step's rows, the body's the sum of the two batches' rows, each
    the loop's and reducing to ``.grad``."""
    model = Net()
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    for_body = torch.optim.SGD(body, lr=0.1)
    for_head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        held: dict[str, torch.Tensor] = {}
        for step in range(4):
            x, y = batch(step)
            want = loop(model, x, y)
            for_head.zero_grad()
            if step % 2 == 0:
                for_body.zero_grad()
            ce(model(x), y).backward()
            for n in want:
                if not n.startswith("head"):
                    held[n] = want[n] + held[n] if step % 2 else want[n]
                    want[n] = held[n]
            assert assert_step(model, want, f"step {step}") == 6
            for_head.step()
            if step % 2:
                for_body.step()


def test_one_grad_scaler_over_two_optimizers_one_unscaled_and_clipped():
    """Float16 autocast, one ``GradScaler`` for two optimizers: the body's gradients unscaled
    (``scaler.unscale_(for_body)``) and clipped, the head's left scaled, both stepped through
    the scaler, one ``update()``. ``grad1`` divided by the scale is each example's own
    gradient (within float16's rounding), not unscaled or clipped; the head's ``.grad`` still
    its mean."""
    model = Net(dtype=F32)
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    for_body = torch.optim.SGD(body, lr=0.1)
    for_head = torch.optim.Adam(model.head.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=F32)
            want = loop(model, x, y)
            for_body.zero_grad()
            for_head.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(ce(out, y)).backward()
            scaler.unscale_(for_body)
            torch.nn.utils.clip_grad_norm_(body, 0.5)
            for n, p in model.named_parameters():
                near(p.grad1 / scale, want[n], FP16, f"step {step}: {n}")
                if n.startswith("head"):
                    near(p.grad1.mean(0), p.grad, FP16, f"step {step}: {n} reduced")
            scaler.step(for_body)
            scaler.step(for_head)
            scaler.update()


# -- parameters a step does not reach, frozen or in eval ---------------------------------------


class NormEval(nn.Module):
    """A Linear, a BatchNorm1d with running statistics of its own, two Linears; ``train()``
    keeps the norm in eval (mmdetection's ``norm_eval=True``), its affine parameters trained."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.norm = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.l2, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)
        self.to(D)

    def train(self, mode: bool = True):
        super().train(mode)
        self.norm.eval()
        return self

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.norm(self.l1(x))))))


def test_batch_norms_kept_in_eval_by_a_train_override_into_the_dp_step():
    """Fine-tuning a detector's way: ``model.train()`` at every step, overridden to keep the
    batch norms in eval (their running statistics frozen, each example normalized alone),
    their affine parameters still trained. ``grad1`` is each example's own gradient, the
    norm's weight and bias too, and the DP step gives the clipped mean and the norms."""
    model = NormEval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            model.train()
            assert not model.norm.training
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == 8
            dp_check(h, model, x, y, want, f"step {step}")
            optimizer.step()


def test_bitfit_biases_alone_then_the_whole_model_unfrozen_by_add_param_group():
    """BitFit: every weight frozen, the biases trained alone for two steps; then the weights
    unfrozen and given to the optimizer by ``add_param_group`` (a lower learning rate). The
    frozen weights have no ``grad1``; from the unfreezing on they have the loop's, and every
    bias's is the loop's throughout."""
    model = Net()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    for p in weights:
        p.requires_grad_(False)
    optimizer = torch.optim.SGD(biases, lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                for p in weights:
                    p.requires_grad_(True)
                optimizer.add_param_group({"params": weights, "lr": 0.01})
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == (6 if step >= 2 else 3)
            for p in weights:
                assert step >= 2 or "grad1" not in p.__dict__, f"step {step}"
            optimizer.step()


class Exits(nn.Module):
    """Three Linear-Tanh layers, an exit classifier after each; ``self.exits`` names those
    a forward runs; their logits stacked, ``[batch, k, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6)])
        self.heads = nn.ModuleList(nn.Linear(6, 3) for _ in range(3))
        self.exits: tuple[int, ...] = (0, 1, 2)
        self.to(D)

    def forward(self, x):
        outs, h = [], x
        for i, layer in enumerate(self.layers[: max(self.exits) + 1]):
            h = torch.tanh(layer(h))
            if i in self.exits:
                outs.append(self.heads[i](h))
        return torch.stack(outs, 1)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros kept"])
def test_an_early_exit_network_whose_exits_each_step_picks(set_to_none):
    """Deep supervision with early exits: each step trains the exits it picks (the mean of
    their losses), the layers past the last picked exit not run. A layer or an exit the step
    does not reach has no ``grad1`` after ``zero_grad()``, and zeros after
    ``zero_grad(set_to_none=False)``, as its ``.grad``; every other ``grad1`` is the loop's,
    and ``check()`` finds nothing wrong (it took those zeros for a ``grad1`` of an earlier
    backward, kept past a ``.grad`` zeroed since)."""
    model = Exits()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    picks = [(0, 1, 2), (0,), (1,), (0, 2)]
    with gradhooks.add_hooks(model) as h:
        for step, exits in enumerate(picks):
            model.exits = exits
            x, y = batch(step)
            want = loop_grad(copy.deepcopy(model), over_samples, x, y)
            optimizer.zero_grad(set_to_none=set_to_none)
            over_samples(model(x), y).backward()
            for n, p in model.named_parameters():
                index = int(n.split(".")[1])
                reached = index in exits if n.startswith("heads") else index <= max(exits)
                if reached:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
                    assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} reduced")
                elif set_to_none:
                    assert p.grad is None and "grad1" not in p.__dict__, f"step {step}: {n}"
                else:
                    assert p.grad1.shape == (4, *p.shape) and not p.grad1.any(), f"{step}: {n}"
                    assert not p.grad.any(), f"step {step}: {n}"
            assert not h.check(raise_on_error=False).problems, f"step {step}"
            optimizer.step()


# -- attention, parametrizations --------------------------------------------------------------


class Attention(nn.Module):
    """An embedding of 4 features to 8, one causal self-attention of 2 heads by
    ``scaled_dot_product_attention`` with a residual, the mean over the tokens to 3 logits."""

    def __init__(self, dtype=D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv = nn.Linear(4, 8), nn.Linear(8, 24)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.to(dtype)

    def forward(self, x):
        h = self.embed(x)
        q, k, v = self.qkv(h).view(*h.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(h.shape))
        return self.head(h.mean(1))


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bfloat16 autocast"])
def test_scaled_dot_product_attention_under_sdpa_kernel_math(bf16):
    """A causal attention by ``F.scaled_dot_product_attention`` run under
    ``sdpa_kernel([SDPBackend.MATH])`` (as GPU scripts pin the kernel), trained by AdamW:
    ``grad1`` is each example's own gradient at every step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = F32 if bf16 else D
    model = Attention(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 5, 4, generator=g, dtype=D).to(dtype)
            y = torch.randint(3, (4,), generator=g)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with sdpa_kernel([SDPBackend.MATH]), autocast(bf16):
                out = model(x)
            ce(out, y).backward()
            assert_step(model, want, f"step {step}", rel=BF16 if bf16 else 0.0)
            optimizer.step()


@pytest.mark.parametrize("trivialization", [True, False], ids=["trivialized", "not trivialized"])
@pytest.mark.parametrize("orthogonal_map", ["cayley", "householder"])
def test_orthogonal_weights_by_the_cayley_and_householder_maps(orthogonal_map, trivialization):
    """``orthogonal(layer, orthogonal_map=..., use_trivialization=...)`` with the maps other
    than the default (``matrix_exp`` for a square weight): the Cayley map solves a linear
    system, the Householder map multiplies reflections; without trivialization the original is
    the orthogonal matrix itself. ``grad1`` of the original is the loop's at every step."""
    model = Net()
    orthogonal(model.l2, orthogonal_map=orthogonal_map, use_trivialization=trivialization)
    with gradhooks.add_hooks(model):
        run(model, live=True)


@pytest.mark.parametrize("cached", [False, True], ids=["computed in the block", "cached"])
def test_an_orthogonal_weight_inside_a_non_reentrant_checkpoint(cached):
    """The middle layer, orthogonal, checkpointed (non-reentrant): its weight is made inside
    the block and made again at the backward, or made once for the forward under
    ``parametrize.cached()``. ``grad1`` of the original is the loop's at every step."""
    model = Checkpointed(reentrant=False, orthogonal_weight=True)

    def forward(x):
        if not cached:
            return model(x)
        with parametrize.cached():
            return model(x)

    with gradhooks.add_hooks(model):
        run(model, forward, live=True)


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.BatchNotFoundError,
    reason="a reentrant checkpoint runs the parametrization under no_grad in the forward and "
    "again at the backward; gradhooks checks every call run again for the batch in its input, "
    "and the parametrization's input (the original weight) holds none, so it is refused "
    "(naming it, and advising use_reentrant=False), where the loop has its gradients",
)
def test_an_orthogonal_weight_inside_a_reentrant_checkpoint():
    """The middle layer, orthogonal, in a reentrant checkpoint: ``grad1`` of the original
    should be the loop's (it is refused today, typed and naming the parametrization)."""
    model = Checkpointed(reentrant=True, orthogonal_weight=True)
    with gradhooks.add_hooks(model):
        run(model, live=True)


# -- wrappers, inputs, evaluations between steps -----------------------------------------------


def test_a_hooked_model_wrapped_in_data_parallel_on_the_cpu():
    """``nn.DataParallel(model)`` after ``add_hooks``, on a machine without a GPU (it calls
    the module as it is): ``grad1`` is the loop's at every step."""
    model = Net()
    with gradhooks.add_hooks(model):
        run(model, nn.DataParallel(model))


class MaxNormEmbedding(nn.Module):
    """``nn.Embedding(10, 6, max_norm=1.0)`` (rows looked up renormalized in place, without
    grad, in the forward) whose rows start longer than 1, the mean over the tokens, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 6, max_norm=1.0), nn.Linear(6, 3)
        with torch.no_grad():
            self.embed.weight.mul_(3.0)
        self.to(D)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def test_an_embedding_renormalized_by_max_norm_in_its_forward():
    """An embedding with ``max_norm``, which renormalizes the rows it looks up in place
    inside its forward: ``grad1`` is each example's own gradient at the renormalized rows (the
    loop's, whose forwards renormalize the same rows), at every step."""
    model = MaxNormEmbedding()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            tokens, y = torch.randint(10, (4, 5), generator=g), torch.randint(3, (4,), generator=g)
            want = loop_grad(copy.deepcopy(model), ce, tokens, y)
            optimizer.zero_grad()
            ce(model(tokens), y).backward()
            assert_step(model, want, f"step {step}")
            assert model.embed.weight[tokens.unique()].norm(dim=1).max() <= 1.0 + 1e-6
            optimizer.step()


def test_a_batch_made_under_inference_mode_fails_in_torch_and_trains_once_cloned():
    """A batch normalized under ``torch.inference_mode()`` (a preprocessing step) and fed to
    the hooked model: torch refuses to save inference tensors for the backward, as without
    gradhooks; nothing is left on the model (no ``.grad``, no ``grad1``). Cloned, the batch
    trains, ``grad1`` the loop's."""
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.inference_mode():
        x, y = batch(0)
        x = (x - x.mean()) / x.std()
    with gradhooks.add_hooks(model):
        with pytest.raises(RuntimeError, match="[Ii]nference tensors"):
            ce(model(x), y).backward()
        for n, p in model.named_parameters():
            assert p.grad is None and "grad1" not in p.__dict__, n
            assert torch.equal(p, before[n]), n
        x, y = x.clone(), y.clone()
        want = loop(model, x, y)
        ce(model(x), y).backward()
        assert_step(model, want, "cloned")


def test_a_validation_with_requires_grad_switched_off_on_the_whole_model():
    """A validation forward with grad mode on but the whole model frozen
    (``model.requires_grad_(False)``, then ``True`` again) after each step: it captures
    nothing, ``grad1`` stays as the step left it, and the next step's is the loop's."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            optimizer.step()
            model.requires_grad_(False)
            model.eval()
            val = ce(model(batch(100 + step)[0]), batch(100 + step)[1])
            assert not val.requires_grad
            model.train()
            model.requires_grad_(True)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), f"step {step}: {n}"


def test_the_model_rounded_through_bfloat16_for_an_evaluation_and_cast_back():
    """After each step the model is cast to bfloat16 (``model.to(torch.bfloat16)``) for an
    evaluation under ``inference_mode`` and cast back to float64, its weights rounded on the
    way: the next step's ``grad1`` is each example's own gradient at the rounded weights,
    exactly, the optimizer still stepping the same parameters."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()
            model.to(torch.bfloat16).eval()
            with torch.inference_mode():
                model(batch(100 + step)[0].to(torch.bfloat16))
            model.to(D).train()
            assert all(p.dtype == D for p in optimizer.param_groups[0]["params"])


def test_check_after_weight_noise_through_functional_call_reads_no_computed_grad():
    """``h.check()`` after a step of weight noise through ``functional_call``: the tensors
    computed in the slots (``p + noise``) got ``grad1`` too, and have no ``.grad`` of their
    own; the check compares the parameters' without asking torch for theirs (which warns of
    a non-leaf tensor's ``.grad``), and finds nothing wrong."""
    model = WeightNoise(2)
    with gradhooks.add_hooks(model.net) as h:
        model.draw(0)
        x, y = batch(0)
        over_samples(model(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = h.check(raise_on_error=False)
    assert not report.problems, report.problems

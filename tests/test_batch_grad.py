"""Batch gradients taken from grad1 (a rule's ``grad_from_grad1``: Linear and convolutions with
many positions per example). The call runs with its parameters detached and a ``_Join`` node
gives ``.grad`` the sum of the call's ``grad1``: ``.grad`` must stay exactly what autograd
computes without hooks, in every setup where autograd computes it, and ``grad1`` must stay the
oracle's. ``GRADHOOKS_SUM_GRAD1_POSITIONS=1 python -m pytest`` runs the whole suite this way."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.models import CifarCNN, TinyGPT
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, cpu_only

D = torch.float64
DETACHED = cpu_only("a call runs detached (its batch gradient from grad1) on the CPU alone")


@pytest.fixture(params=[1, None], ids=["every-call", "default-threshold"])
def threshold(request):
    if request.param is None:
        yield gradhooks.TUNING.sum_grad1_positions
        return
    with gradhooks.tuned(sum_grad1_positions=request.param) as tuning:
        yield tuning.sum_grad1_positions


class ConvSeq(nn.Module):
    """A conv with an in-place ReLU on its output, a reused Linear over 40 positions, a Linear
    on [batch, features]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.seq = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):  # [batch, 2, 40]
        h = F.relu(self.conv(x), inplace=True).transpose(1, 2)  # [batch, 40, 3]
        h = torch.tanh(self.seq(self.seq(h)))  # called twice: grad1 accumulates
        return self.head(h.mean(1))


def attached(out) -> bool:
    """Whether ``out``'s autograd history starts with a _Join node (for an output that is a
    view, the in-place attach puts it behind the view's own nodes)."""
    nodes = [out.grad_fn]
    for _ in range(3):
        if any(type(n).__name__ == "_JoinBackward" for n in nodes):
            return True
        nodes = [f for n in nodes if n is not None for f, _ in n.next_functions]
    return False


def attach_nodes(model, x):
    """Whether each hooked layer call's output is attached, in call order."""
    seen = []
    handles = [
        m.register_forward_hook(lambda m, a, out: seen.append(attached(out)))
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))
    ]
    model(x)
    for h in handles:
        h.remove()
    return seen


def plain_grads(model, loss_fn, x, y):
    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


@DETACHED
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("quantity", ["grad1", "norms", "sum_grad_sq"])
def test_grad_and_grad1_against_oracles(threshold, reduction, quantity):
    """With norms (or squared sums) only, the batch gradient is a by-product of the norms (or
    of the squares) where they form the per-example gradient a slice at a time (the conv), else
    the pieces' batch sum; the squared sums' gradient mean is that same batch gradient."""
    torch.manual_seed(0)
    model = ConvSeq().to(D)
    x, y = torch.randn(5, 2, 40, dtype=D), torch.randint(0, 2, (5,))
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction=reduction)  # noqa: E731
    want = vmap_grad(model, loss_fn, x, y)
    loop = loop_grad(model, loss_fn, x, y)
    grads = plain_grads(model, loss_fn, x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=(quantity,)) as h:
        nodes = attach_nodes(model, x)
        # with the default threshold: the conv and the reused Linear (40 positions), not the head
        assert nodes == [True, True, True, threshold == 1], nodes
        loss_fn(model(x), y).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad, grads[n], f"{n} .grad vs autograd without hooks")
        if quantity == "grad1":
            assert_close(p.grad1, want[n], f"{n} grad1 vs vmap")
            assert_close(p.grad1, loop[n], f"{n} grad1 vs loop")
        elif quantity == "norms":
            assert_close(h.param_norms()[n], want[n].flatten(1).norm(dim=1), f"{n} norms")
        else:
            assert_close(h.sum_grad_sq()[n], want[n].square().sum(0), f"{n} squared sums")
            variance = want[n].var(0, unbiased=False)
            assert_close(h.grad_variance()[n], variance, f"{n} gradient variance")


@DETACHED
@pytest.mark.parametrize("make", [lambda: CifarCNN(width=4), lambda: TinyGPT(layers=1)])
def test_in_tree_models(threshold, make):
    torch.manual_seed(0)
    model = make().to(D)
    if isinstance(model, TinyGPT):
        x, y = torch.randint(0, 64, (3, 40)), torch.randint(0, 64, (3, 40))
        loss_fn = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    else:
        x, y = torch.randn(3, 3, 32, 32, dtype=D), torch.randint(0, 10, (3,))
        loss_fn = F.cross_entropy
    want = vmap_grad(model, loss_fn, x, y)
    grads = plain_grads(model, loss_fn, x, y)
    with gradhooks.add_hooks(model):
        assert any(attach_nodes(model, x))
        loss_fn(model(x), y).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"{n} grad1 vs vmap")
        assert_close(p.grad, grads[n], f"{n} .grad vs autograd without hooks")


@pytest.mark.parametrize("kind", ["conv", "attention"])
def test_backwards_that_write_no_grad1_still_give_grad(threshold, kind):
    """A paused backward, a second backward without clear() and .grad accumulation: .grad is
    autograd's (from the rule's pieces where no grad1 was computed; self-attention's carry runs
    the call's forward again for the paused backward)."""
    torch.manual_seed(0)
    if kind == "conv":
        model, x, watched = ConvSeq().to(D), torch.randn(4, 2, 40, dtype=D), "conv.weight"
    else:
        model, x, watched = AttnSeq().to(D), torch.randn(4, 40, 4, dtype=D), "attn.in_proj_weight"
    y = torch.randint(0, 2, (4,))
    ref = copy.deepcopy(model)
    with gradhooks.add_hooks(model) as h:
        out = model(x)
        with h.paused():
            F.cross_entropy(out, y).backward(retain_graph=True)
        assert not hasattr(model.get_parameter(watched), "grad1")
        want_paused = plain_grads(ref, F.cross_entropy, x, y)[watched]
        assert_close(model.get_parameter(watched).grad, want_paused, f"paused: .grad of {watched}")
        (2 * F.cross_entropy(out, y)).backward()  # captured; .grad accumulates
        want = vmap_grad(model, lambda o, t: 2 * F.cross_entropy(o, t), x, y)
        F.cross_entropy(model(x), y).backward()  # grad1 accumulates too
    out = ref(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    (2 * F.cross_entropy(out, y)).backward()
    F.cross_entropy(ref(x), y).backward()
    once = vmap_grad(model, F.cross_entropy, x, y)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, r.grad, f"{n} .grad")
        assert_close(p.grad1, want[n] + once[n], f"{n} grad1 of the two captured backwards")


def test_input_gradient_penalty(threshold):
    """WGAN-GP's penalty: ‖∂out/∂x‖² through a create_graph backward, differentiated with
    respect to the parameters (outside capture). The input-gradient depends on the detached
    weights; the _Join node's correction carries that dependence."""
    torch.manual_seed(0)
    model = ConvSeq().to(D)
    x = torch.randn(4, 2, 40, dtype=D, requires_grad=True)
    ref = copy.deepcopy(model)

    def penalty(m):
        (dx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        return dx.pow(2).sum()

    penalty(ref).backward()
    with gradhooks.add_hooks(model) as h:
        value = penalty(model)
        with h.paused():
            value.backward()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is None:  # head.bias: the input-gradient does not depend on it
            assert p.grad is None, n
        else:
            assert_close(p.grad, r.grad, f"{n} gradient of the penalty")


def test_forward_that_raises_leaves_the_parameters_in_place(threshold):
    model = ConvSeq().to(D)
    weight = model.conv.weight
    with gradhooks.add_hooks(model):
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 5, 40, dtype=D))  # 5 channels, the conv takes 2
        assert model.conv._parameters["weight"] is weight
        assert isinstance(model.conv.weight, nn.Parameter)
        x = torch.randn(4, 2, 40, dtype=D)
        F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1])).backward()
        assert model.conv.weight.grad1.shape == (4, *weight.shape)


def test_parameters_are_restored_after_every_forward(threshold):
    model = ConvSeq().to(D)
    params = dict(model.named_parameters())
    with gradhooks.add_hooks(model):
        model(torch.randn(4, 2, 40, dtype=D))
        assert dict(model.named_parameters()) == params
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


@DETACHED
def test_nothing_is_swapped_on_the_module_during_its_call(threshold):
    """The call gets its detached parameters from the forward's tracker, at each torch
    function: a pre-hook that runs after gradhooks' still finds the module's own parameters."""
    model = ConvSeq().to(D)
    seen = []
    with gradhooks.add_hooks(model):
        model.conv.register_forward_pre_hook(
            lambda m, args: seen.append(m._parameters["weight"] is weight)
        )
        weight = model.conv.weight
        out = model(torch.randn(4, 2, 40, dtype=D))
        assert attached(model.conv(torch.randn(4, 2, 40, dtype=D))) or threshold > 1
        out.sum().backward()
    assert seen and all(seen)


def test_a_weight_changed_in_place_before_the_backward_is_autograds_error(threshold):
    """The call's nodes save the detached weight, which shares the parameter's version
    counter: autograd's own in-place check still fires."""
    model = ConvSeq().to(D)
    with gradhooks.add_hooks(model):
        out = model(torch.randn(4, 2, 40, dtype=D))
        with torch.no_grad():
            model.seq.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


class _Times(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=D))

    def forward(self, x):
        return _Times.apply(x, self.w)  # (an autograd.Function: no torch function sees w)


def test_a_parameter_no_torch_function_sees_is_refused_not_counted_twice():
    """grad_from_grad1 needs the call's torch functions to receive its parameters: a layer
    that hands one to an autograd.Function would keep autograd's batch gradient too. Its
    first call is refused at the forward, with or without the check of the backward, instead
    of doubling ``.grad``."""
    registry = gradhooks.Registry()

    @registry.register(_Scale, grad_from_grad1=lambda m, args: True)
    def rule(call):
        (x,) = call.inputs
        return {"w": gradhooks.Direct((x * call.grad_output).sum(1))}

    model = nn.Sequential(_Scale())
    x = torch.randn(4, 5, 3, dtype=D)
    for verify in (True, False):  # (refused at the forward, before the check could run)
        with gradhooks.add_hooks(model, registry=registry, verify=verify):
            with pytest.raises(
                gradhooks.UnsupportedError, match=r"'0' \(_Scale\) hands its parameter 'w'"
            ):
                model(x)
    assert not hasattr(model[0].w, "grad1")
    model(x).sum().backward()  # (the model as it was)
    assert_close(model[0].w.grad, (x * 1.0).sum((0, 1)), "w .grad")


@DETACHED
def test_output_seen_by_an_earlier_hook_keeps_its_weight_gradient(threshold):
    """A forward hook registered before add_hooks (an activation regularizer) still sees the
    output attached again: the engine's forward hook runs first among a module's own."""
    torch.manual_seed(0)
    model = ConvSeq().to(D)
    x, y = torch.randn(4, 2, 40, dtype=D), torch.randint(0, 2, (4,))
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.kept = []
        m.conv.register_forward_hook(lambda mod, a, out, m=m: m.kept.append(out))

    def loss(m):
        return F.cross_entropy(m(x), y, reduction="sum") + m.kept.pop().pow(2).sum()

    loss(ref).backward()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        assert attach_nodes(model, x)[0] is True  # the conv: attached
        model.kept.clear()
        loss(model).backward()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, r.grad, f"{n} .grad")


def test_global_forward_hook_turns_it_off(threshold):
    model = ConvSeq().to(D)
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        with gradhooks.add_hooks(model):
            assert not any(attach_nodes(model, torch.randn(2, 2, 40, dtype=D)))
    finally:
        handle.remove()


# -- self-attention: the parameters carried by the input ------------------------------------------
# The rule of nn.MultiheadAttention runs when the backward reaches the in-projection inside the
# call, after the call's output: in_proj_weight and in_proj_bias are attached to the call's
# input instead (a _Join node), whose backward runs after the whole call.


class AttnSeq(nn.Module):
    """A Linear, causal self-attention over the positions (as TinyGPT calls it), a head."""

    def __init__(self, batch_first=True, first=False, need_weights=False):
        super().__init__()
        self.batch_first, self.first, self.need_weights = batch_first, first, need_weights
        self.embed = nn.Linear(4, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # [batch, 40, 4]
        h = x if self.first else torch.tanh(self.embed(x))
        if not self.batch_first:
            h = h.transpose(0, 1)
        mask = torch.triu(torch.ones(40, 40, dtype=torch.bool), 1)
        h = h + self.attn(h, h, h, attn_mask=mask, need_weights=self.need_weights)[0]
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


def joins(node, param) -> bool:
    """Whether ``node`` is a _Join node that joins its tensor to ``param``."""
    return type(node).__name__ == "_JoinBackward" and any(
        getattr(f, "variable", None) is param for f, _ in node.next_functions
    )


def carried(model, x) -> bool:
    """Whether the attention's input came through a _Join node joined to its in-projection."""
    seen = []
    handle = model.attn.register_forward_hook(
        lambda m, a, out: seen.append(joins(a[0].grad_fn, m.in_proj_weight))
    )
    model(x)
    handle.remove()
    return seen == [True]


@DETACHED
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("layout", ["batch_first", "seq_first", "input_first"])
def test_carried_attention_against_oracles(threshold, reduction, layout):
    """grad1 against vmap(grad) and the loop, .grad against autograd without hooks; the
    attention's input is the model's own (no grad) with ``input_first``."""
    torch.manual_seed(0)
    model = AttnSeq(batch_first=layout != "seq_first", first=layout == "input_first").to(D)
    x, y = torch.randn(5, 40, 4, dtype=D), torch.randint(0, 2, (5,))
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction=reduction)  # noqa: E731
    want = vmap_grad(model, loss_fn, x, y)
    loop = loop_grad(model, loss_fn, x, y)
    grads = plain_grads(model, loss_fn, x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction) as h:
        assert carried(model, x)
        loss_fn(model(x), y).backward()
        h.check(loss_fn, x, y)
    for n, p in model.named_parameters():
        if layout == "input_first" and n.startswith("embed"):
            continue
        assert_close(p.grad, grads[n], f"{n} .grad vs autograd without hooks")
        assert_close(p.grad1, want[n], f"{n} grad1 vs vmap")
        assert_close(p.grad1, loop[n], f"{n} grad1 vs loop")


@DETACHED
def test_carried_attention_only_where_it_pays(threshold):
    """Not with fewer positions than the threshold, not with norms only (the sum of grad1 is
    what replaces autograd's batch gradient), not for cross-attention."""
    model = AttnSeq().to(D)
    x = torch.randn(2, 40, 4, dtype=D)
    with gradhooks.add_hooks(model, quantities=("norms",)):
        assert not carried(model, x)
    with gradhooks.add_hooks(model):
        assert carried(model, x) == (threshold <= 40)
        seen = []
        model.attn.register_forward_hook(lambda m, a, out: seen.append(a[0].grad_fn))
        h = torch.randn(2, 40, 4, dtype=D, requires_grad=True)
        model.attn(h, h + 0, h + 0)
        assert not joins(seen[0], model.attn.in_proj_weight)


@DETACHED
@pytest.mark.parametrize("first", [False, True])
def test_carried_attention_input_gradient_penalty(threshold, first):
    """‖∂out/∂x‖² through a create_graph backward, differentiated with respect to the
    parameters: the input-gradient the call's own nodes give has no graph through the detached
    in-projection; the carry's correction adds exactly that part (no other term twice). (With
    need_weights: torch's fused attention has no double backward on CPU.)"""
    torch.manual_seed(0)
    model = AttnSeq(first=first, need_weights=True).to(D)
    x = torch.randn(3, 40, 4, dtype=D, requires_grad=True)
    ref = copy.deepcopy(model)

    def penalty(m):
        (dx,) = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
        return dx.pow(2).sum()

    penalty(ref).backward()
    with gradhooks.add_hooks(model) as h:
        assert carried(model, x)
        value = penalty(model)
        with h.paused():
            value.backward()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is None:
            assert p.grad is None, n
        else:
            assert_close(p.grad, r.grad, f"{n} gradient of the penalty")


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_carried_attention_dp_step(threshold, method):
    """The DP step's clipped gradients against the clipped loop (the book-keeping step's
    second backward gives the carried parameters no gradient of their own)."""
    torch.manual_seed(0)
    model = AttnSeq().to(D)
    x, y = torch.randn(5, 40, 4, dtype=D), torch.randint(0, 2, (5,))
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    factors = torch.clamp(max_norm / norms, max=1.0)
    with gradhooks.add_hooks(model, quantities=("grad1" if method == "grad1" else "norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        got = gradhooks.dp_sgd_step(
            h, losses, max_norm=max_norm, noise_multiplier=0.0, method=method
        )
    assert_close(got, norms, "norms")
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", factors, loop[name]) / 5
        assert_close(p.grad, want, f"{method}: clipped {name}")


class Checkpointed(nn.Module):
    """A Linear pair and a convolution over 40 positions under activation checkpointing
    (``reentrant=None``: without it, the reference)."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.conv = nn.Linear(4, 8), nn.Linear(8, 4), nn.Conv1d(4, 4, 3, padding=1)

    def block(self, x):  # [batch, 40, 4]
        return self.b(torch.tanh(self.a(x))) + self.conv(x.transpose(1, 2)).transpose(1, 2)

    def forward(self, x):
        if self.reentrant is None:
            return self.block(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(threshold, reentrant):
    """The checkpointed calls run again at the backward, where no tracker follows the forward
    (a non-reentrant checkpoint refuses a recomputation that saves other tensors than the
    forward did), and grad1 and .grad are the oracles'."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(D)
    ref = copy.deepcopy(model)
    ref.reentrant = None
    x = torch.randn(3, 40, 4, dtype=D, requires_grad=True)
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    want = vmap_grad(ref, loss_fn, x.detach())
    grads = {n: g.sum(0) for n, g in want.items()}
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss_fn(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"{n} grad1 vs vmap")
        assert_close(p.grad, grads[n], f"{n} .grad vs the sum of the per-example gradients")


class CheckpointedLayouts(nn.Module):
    """A Linear under non-reentrant activation checkpointing on an input whose examples are
    not on dimension 0: folded with the positions (OPT's ``[batch * time, features]``), or
    sequence-first (``[time, batch, channels, features]``)."""

    def __init__(self, layout, reentrant=False):
        super().__init__()
        self.layout, self.fc, self.reentrant = layout, nn.Linear(8, 8), reentrant

    def block(self, x):
        if self.layout == "folded":
            b, t, e = x.shape
            return self.fc(x.reshape(b * t, e)).reshape(b, t, -1)
        return self.fc(x.transpose(0, 1)).transpose(0, 1)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("layout", ["folded", "sequence-first"])
def test_checkpointed_calls_with_their_examples_elsewhere(threshold, layout):
    """The forward's tracker sees the layout and runs the call as autograd does; the
    recomputation at the backward, with no tracker, must do the same (a non-reentrant
    checkpoint refuses other saved tensors). 16 channels: 48 positions per call
    sequence-first, above the default threshold."""
    torch.manual_seed(0)
    model = CheckpointedLayouts(layout).to(D)
    shape = (3, 4, 8) if layout == "folded" else (3, 4, 16, 8)
    x = torch.randn(*shape, dtype=D)
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    want = loop_grad(model, loss_fn, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss_fn(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"{n} grad1 vs the loop")
        assert_close(p.grad, want[n].sum(0), f"{n} .grad vs the sum of the per-example gradients")


@pytest.mark.parametrize("layout", ["folded", "sequence-first"])
def test_reentrant_checkpoint_of_calls_with_their_examples_elsewhere(layout):
    """A reentrant checkpoint runs the call under no_grad in the forward and again during the
    backward, where no tracker follows the batch: the rule would read dimension 0 (12 rows
    folded, 4 time steps sequence-first) as the examples. Refused, naming the layer, with
    nothing written; the same model without the recomputation then matches the loop."""
    torch.manual_seed(0)
    model = CheckpointedLayouts(layout, reentrant=True).to(D)
    shape = (3, 4, 8) if layout == "folded" else (3, 4, 16, 8)
    x = torch.randn(*shape, dtype=D, requires_grad=True)
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'fc' \(Linear\).*use_reentrant"):
            loss_fn(model(x)).backward()
        assert all(not hasattr(p, "grad1") for p in model.parameters())
        model.reentrant = False
        want = loop_grad(model, loss_fn, x.detach())
        model.zero_grad()
        loss_fn(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"{n} grad1 vs the loop")

"""Real training setups, each against the oracle."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import vmap_grad
from harness import Case, assert_close, assert_matches, check, mlp, sq

D = torch.float64


def norms_of(want):
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


# -- in-place activations, views and reshapes -----------------------------------------------------


class Views(nn.Module):
    """Layer outputs viewed, reshaped, sliced, transposed and modified in place."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.b = nn.Linear(12, 3)

    def forward(self, x):  # x: [batch, 4]
        h = F.relu(self.a(x), inplace=True)  # in place on the hooked output
        h = h.view(-1, 1, 2, 3)  # a view of it
        h = self.conv(h)
        h.mul_(2.0)  # in place on a conv output
        h = h.transpose(2, 3).reshape(h.shape[0], -1)  # [batch, 12]
        return self.b(h)[:, :2]  # a slice of the output


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_inplace_and_views_of_layer_outputs(reduction):
    check(Case("views", Views, lambda b: torch.randn(b, 4)), batch=4, reduction=reduction)
    check(
        Case("inplace_relu", lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True),
                                                    nn.Linear(4, 2)), lambda b: torch.randn(b, 3)),
        batch=3, reduction=reduction,
    )  # fmt: skip


# -- activation checkpointing ---------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing (the reference)
        self.stem = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        if self.reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        h = self.block(h)  # the block used again, outside the checkpoint
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_counts_once(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant).double()
    x = torch.randn(5, 3, dtype=D)
    ref = copy.deepcopy(model)
    ref.reentrant = None
    want = vmap_grad(ref, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        sq(model(x)).backward()
        assert_matches(model, want, "checkpointed")
        assert_close(h.norms(), norms_of(want), "checkpointed norms")
        h.clear()
        sq(model(x)).backward()  # a second step: nothing left over from the recomputation
        assert_matches(model, want, "second step")


class CheckpointedBlock(nn.Module):
    """A transformer-like block under non-reentrant checkpointing: LayerNorms (whose rule
    would read the statistics their forward saved, which would run the block again inside
    the forward) and a batch-free table looked up with ``arange(T)`` that multiplies the batch
    (as rotary embeddings do), inside the checkpoint, whose recomputation must save the same
    tensors as the forward."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.stem, self.ln1, self.ln2 = nn.Linear(3, 4), nn.LayerNorm(4), nn.LayerNorm(4)
        self.pos, self.mid, self.head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def block(self, h):
        pos = self.pos(torch.arange(h.shape[1]))
        return self.ln2(h + torch.tanh(self.mid(self.ln1(h)) * pos))

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.head(h)


def test_non_reentrant_checkpointing_saves_what_it_saves_untracked():
    torch.manual_seed(0)
    model = CheckpointedBlock(True).double()
    x = torch.randn(3, 5, 3, dtype=D)
    ref = copy.deepcopy(model)
    ref.checkpointed = False
    want = vmap_grad(ref, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_matches(model, want, "checkpointed")


# -- autograd.grad, several backwards, create_graph -----------------------------------------------


def test_autograd_grad_instead_of_backward():
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(model, sq, x)
    params = list(model.parameters())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        grads = torch.autograd.grad(sq(model(x)), params)
    assert_matches(model, want, "autograd.grad")
    for p, g in zip(params, grads):
        assert p.grad is None
        assert_close(p.grad1.sum(0), g, "grad1 sums to autograd.grad's result")


def test_input_gradient_in_between_is_not_captured():
    """An input-gradient (saliency, the first derivatives of a Laplacian) with
    torch.autograd.grad computes no parameter gradient: it leaves grad1 alone."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    want = vmap_grad(model, sq, x.detach())
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        out = model(x)
        (dx,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
        sq(out).backward()
        assert_matches(model, want, "after an input-gradient")
        assert_close(h.norms(), norms_of(want), "norms")
        torch.autograd.grad(model(x).sum(), x)  # after the backward: grad1 stays
        assert_matches(model, want, "an input-gradient after the backward")


def test_which_backward_is_captured():
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    other = lambda out: out[:, 0].exp().sum()  # noqa: E731
    want = vmap_grad(model, sq, x)
    # capture="marked": only backwards inside h.capturing()
    with gradhooks.add_hooks(model, loss_reduction="sum", capture="marked") as h:
        out = model(x)
        other(out).backward(retain_graph=True)  # e.g. an auxiliary objective: not captured
        assert not hasattr(model[0].weight, "grad1")
        with h.capturing():
            sq(out).backward(retain_graph=True)
        other(out).backward()
        assert_matches(model, want, "marked")
    gradhooks.clear_grad1(model)
    # capture="always" (default): h.paused() excludes a backward
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        out = model(x)
        with h.paused():
            other(out).backward(retain_graph=True)
        sq(out).backward()
        assert_matches(model, want, "paused")


def test_laplacian_loss_is_refused():
    """The forum thread's loss: a Laplacian built with autograd.grad(create_graph=True). Its
    per-example gradients have terms through the double backward that no hook sees."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    with gradhooks.add_hooks(model):
        u = model(x)[:, 0]
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        lap = sum(
            torch.autograd.grad(du[:, j].sum(), x, create_graph=True)[0][:, j] for j in range(3)
        )
        loss = (lap + u).pow(2).mean()
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"create_graph=True.*grad1 would be wrong.*vmap_grad"
        ):
            loss.backward()


def test_differentiate_through_grad1_with_create_graph():
    """grad1 from a create_graph backward has a graph: the gradient of Σ_i ‖grad1_i‖² matches
    torch.func."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())

    def per_example(ps):
        def one(ps, xi):
            return sq(functional_call(model, ps, (xi[None],)))

        return vmap(grad(one), in_dims=(None, 0))(ps, x)

    def objective(ps):
        return sum(g.pow(2).sum() for g in per_example(ps).values())

    ps = {n: p.detach() for n, p in model.named_parameters()}
    want = grad(objective)(ps)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        torch.autograd.grad(sq(model(x)), params, create_graph=True)
        value = sum(p.grad1.pow(2).sum() for p in params)
        assert value.requires_grad
        with pytest.raises(gradhooks.UnsupportedError, match=r"h.paused\(\)"):
            torch.autograd.grad(value, params, retain_graph=True)
        with h.paused():
            got = torch.autograd.grad(value, params)
    for n, g in zip(names, got):
        assert_close(g, want[n], f"d Σ‖grad1‖² / d {n}")


# -- precision, memory format, micro-batches -----------------------------------------------------


@pytest.mark.parametrize("backward_inside", [False, True])
def test_autocast_bfloat16_accumulates_in_float32(backward_inside):
    """grad1 in float32 under CPU autocast, also where the backward runs inside the autocast
    block (the rules' products then see autocast too)."""
    model = mlp(torch.float32)
    x = torch.randn(8, 3)
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            assert out.dtype == torch.bfloat16
            if backward_inside:
                sq(out.float()).backward()
        if not backward_inside:
            sq(out.float()).backward()
    for _n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32
    assert_matches(model, want, "bf16", rtol=5e-2, atol=5e-2)


@pytest.mark.cuda
def test_autocast_float16_cuda():
    model = mlp(torch.float32).cuda()
    x = torch.randn(8, 3, device="cuda")
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        sq(out.float()).backward()
    for _n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32
    assert_matches(model, want, "fp16", rtol=2e-2, atol=2e-2)


def test_channels_last():
    def cnn():
        return nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(3, 2, 3, stride=2),
            nn.Flatten(),
            nn.Linear(8, 2),
        ).to(memory_format=torch.channels_last)

    case = Case(
        "channels_last", cnn,
        lambda b: torch.randn(b, 2, 5, 5).to(memory_format=torch.channels_last),
    )  # fmt: skip
    check(case, batch=3, reduction="mean")


def test_micro_batches_give_separate_examples():
    """Gradient accumulation: clear() after each micro-batch's backward and keep its grad1;
    concatenated they are the full batch's per-example gradients. (Without clear(), grad1 adds
    up like .grad does.)"""
    model = mlp()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(2, (6,))
    want = vmap_grad(model, F.cross_entropy, x, y)
    chunks = {n: [] for n, _ in model.named_parameters()}
    with gradhooks.add_hooks(model) as h:  # each micro-batch's loss is its own mean
        for xb, yb in zip(x.split(2), y.split(2)):
            h.clear()
            (F.cross_entropy(model(xb), yb) / 3).backward()  # scaled for .grad accumulation
            for n, p in model.named_parameters():
                chunks[n].append(p.grad1 * 3)  # the 1/3 scales grad1 as it scales .grad
    for n, p in model.named_parameters():
        assert_close(torch.cat(chunks[n]), want[n], f"micro-batches {n}")
        assert_close(want[n].mean(0), p.grad, f".grad accumulated {n}")


# -- torch.compile ------------------------------------------------------------------------------


def test_torch_compile_on_a_hooked_model():
    """The hooks run eagerly (a graph break around each hooked layer) and grad1 is right."""
    dynamo = pytest.importorskip("torch._dynamo")
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(model, sq, x)
    dynamo.reset()
    try:
        with gradhooks.add_hooks(model, loss_reduction="sum") as h:
            compiled = torch.compile(model, backend="aot_eager")
            sq(compiled(x)).backward()
            assert_matches(model, want, "compiled")
            h.clear()
            sq(compiled(x)).backward()  # the compiled code reused
            assert_matches(model, want, "compiled, second call")
    finally:
        dynamo.reset()


# -- several models, copies, pickles ------------------------------------------------------------


def test_several_hooked_models_at_once():
    torch.manual_seed(0)
    enc, dec = mlp(), nn.Sequential(nn.Linear(2, 3)).double()
    x = torch.randn(4, 3, dtype=D)
    want_dec = vmap_grad(dec, sq, enc(x).detach())
    with (
        gradhooks.add_hooks(enc, loss_reduction="sum"),
        gradhooks.add_hooks(dec, loss_reduction="sum"),
    ):
        h = enc(x)
        sq(dec(h.detach())).backward()  # the decoder's own loss
        sq(enc(x)).backward()  # the encoder's own loss
    assert_matches(dec, want_dec, "decoder")
    assert_matches(enc, vmap_grad(enc, sq, x), "encoder")


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_hooked_model_copied_or_pickled(how):
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if how == "pickle":
            copy_ = pickle.loads(pickle.dumps(model))
        elif how == "torch.save":
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            copy_ = torch.load(buf, weights_only=False)
        else:
            copy_ = copy.deepcopy(model)
        sq(copy_(x)).backward()  # the copy is not hooked
        assert all(not hasattr(p, "grad1") for p in copy_.parameters())
        assert all(not hasattr(p, "grad1") for p in model.parameters())
        sq(model(x)).backward()  # the original still is
        assert_matches(model, want, "original")
    with gradhooks.add_hooks(copy_, loss_reduction="sum"):  # and the copy can be hooked
        sq(copy_(x)).backward()
    assert_matches(copy_, want, "hooked copy")

"""Bad input: each is either right or an error naming the module, the parameter, the shapes and
what to do."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from gradhooks.tracking import MIXED, Layout, Tracker
from harness import Between, MixedBackward, assert_close, assert_matches, mlp, sq

D = torch.float64


# -- NaN/Inf in an example -------------------------------------------------------------------------


def test_nan_is_carried_through_and_reported():
    model = mlp()
    x = torch.randn(5, 3, dtype=D)
    x[2, 1] = float("inf")
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        sq(model(x)).backward()
        report = h.check(raise_on_error=False)
    g1 = model[0].weight.grad1
    assert not torch.isfinite(g1[2]).all(), "NaN/Inf is carried through, as autograd does"
    assert torch.isfinite(g1[[0, 1, 3, 4]]).all(), "the other examples stay finite"
    assert not torch.isfinite(model[0].weight.grad).all()
    assert report.nonfinite["0.weight"] == [2]
    assert any("NaN or Inf for examples [2]" in p for p in report.problems)


class Positions(nn.Module):
    """A learned position embedding looked up with ``arange(T)``: a batch-free call whose
    output meets the batch in ``x + pos``."""

    def __init__(self):
        super().__init__()
        self.pos, self.l = nn.Embedding(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.l(x + self.pos(torch.arange(x.shape[1])))


def test_nan_through_a_batch_free_call_stays_with_its_example():
    """An Inf in one example's input gives that example NaN gradients, also in the share of
    the position embedding that meets the batch; the other examples keep theirs."""
    torch.manual_seed(0)
    model = Positions().double()
    x = torch.randn(5, 4, 3, dtype=D)
    want = rowwise_grad(model, sq_rows, x)
    x[2, 1, 0] = float("inf")
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    g1 = model.pos.weight.grad1
    assert not torch.isfinite(g1[2]).all(), "NaN/Inf is carried through, as autograd does"
    assert_close(g1[[0, 1, 3, 4]], want["pos.weight"][[0, 1, 3, 4]], "the other examples")


# -- nothing captured, several forwards, removal while pending ------------------------------------


def test_hooks_added_after_the_forward_warn_at_the_backward():
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    out = model(x)
    h = gradhooks.add_hooks(model)
    with pytest.warns(gradhooks.GradhooksWarning, match="no forward call of their modules"):
        sq(out).backward()
    assert not hasattr(model[0].weight, "grad1")
    with pytest.raises(gradhooks.CheckFailedError, match="before add_hooks"):
        h.check()
    with pytest.raises(gradhooks.StateError):
        gradhooks.compute_grad1(model)
    h.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a captured step does not warn
        sq(model(x)).backward()
    h.remove()


def test_a_backward_with_nothing_captured_leaves_no_earlier_grad1():
    """A step whose forward was not captured (paused here; a method of the model that uses a
    parameter outside any submodule's call is another) warns, and the parameters keep no
    grad1 of an earlier step to be read as this one's."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(model) as h:
        sq(model(x)).backward()
        h.clear()
        with h.paused():
            out = model(x)
        with pytest.warns(gradhooks.GradhooksWarning, match="no grad1 from this backward"):
            sq(out).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_second_forward_before_the_backward():
    model = mlp()
    x1, x2 = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    want1, want2 = vmap_grad(model, sq, x1), vmap_grad(model, sq, x2)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        out1, out2 = model(x1), model(x2)  # two graphs pending
        sq(out2).backward()  # reaches only its own graph
        assert_matches(model, want2, "second forward's backward")
        h.clear()
        sq(out1).backward()
        assert_matches(model, want1, "first forward's backward")
        # one backward over two forwards of different batch sizes: no per-example pairing
        out1, out3 = model(x1), model(torch.randn(3, 3, dtype=D))
        h.clear()
        with pytest.raises(gradhooks.StateError, match=r"holds \(\d, 2, 5\).*gives \(\d, 2, 5\)"):
            (sq(out1) + sq(out3)).backward()


def test_removed_while_a_backward_is_pending():
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms"))
    out = model(x)
    h.remove()
    sq(out).backward()  # no error, nothing written
    assert all(not hasattr(p, "grad1") for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())
    assert not h._state.collector._expected and not h._state.collector._held


# -- layers that see another batch, inputs without a batch dimension ------------------------------


class TimeFolded(nn.Module):
    """[batch, time, features] folded into [batch * time, features] for the Linear."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x):
        b, t, f = x.shape
        return self.proj(x.reshape(b * t, f)).view(b, t, -1)


class SeqFirst(nn.Module):
    """Batch-first input; one layer run sequence-first ([seq, batch, features]) inside."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.proj(x.transpose(0, 1)).transpose(0, 1))


@pytest.mark.parametrize("model", [TimeFolded, SeqFirst], ids=["time-folded", "seq-first"])
@pytest.mark.parametrize("batch_dim", ["auto", 0])
def test_layer_that_sees_the_batch_elsewhere_is_followed(model, batch_dim):
    """A layer that sees the examples folded with time ([batch * time, features]) or on
    dimension 1 ([seq, batch, features]): its rows are not examples, and grad1 is still each
    example's own gradient (the batch is followed through the reshapes)."""
    torch.manual_seed(0)
    m = model().double()
    x = torch.randn(2, 5, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, batch_dim=batch_dim, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, model.__name__)
    # no batch: grad1 then has a row per entry of the layer's dimension 0
    with gradhooks.add_hooks(m, batch_dim=None, loss_reduction="sum"):
        m(x).pow(2).sum().backward()
    assert m.proj.weight.grad1.shape[0] == (10 if model is TimeFolded else 5)


@pytest.mark.parametrize("kernel", [2, (2, 2)], ids=["int", "tuple"])
def test_image_patches_by_unfold(kernel):
    """``F.unfold`` (not ``Tensor.unfold``, whose arguments are a dimension and a size) keeps
    each example on dimension 0: the Linear on its patches gets each example's gradient."""
    torch.manual_seed(0)

    class Patches(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):  # [batch, 2, 3, 3] -> patches [4, batch, 8], as many as examples
            return self.fc(F.unfold(x, kernel).permute(2, 0, 1)).transpose(0, 1)

    m = Patches().double()
    x = torch.randn(4, 2, 3, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, f"unfold {kernel}")


class _HeadsFolded(nn.Module):
    """Attention written sequence-first with the heads folded into the batch, as torch 1.x's
    and Opacus' ``DPMultiheadAttention`` do: ``[T, B, D]`` viewed as ``[T, B * H, D / H]``."""

    def __init__(self, dim=4, heads=2):
        super().__init__()
        self.heads, self.q, self.k, self.out = (
            heads,
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
        )

    def forward(self, x):  # [T, B, D]
        t, b, d = x.shape
        fold = lambda h: h.contiguous().view(t, b * self.heads, d // self.heads).transpose(0, 1)
        q, k = fold(self.q(x)), fold(self.k(x))
        o = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1), q)
        return self.out(o.transpose(0, 1).contiguous().view(t, b, d))


@pytest.mark.parametrize("batch", [1, 3])
def test_heads_folded_into_a_sequence_first_batch(batch):
    """Also for one example, whose only entry two reshapes may put on different dimensions
    (it mixes with nothing): each example's own gradient, with batch_dim=1."""
    torch.manual_seed(0)
    m = _HeadsFolded().double()
    x = torch.randn(5, batch, 4, dtype=D)
    params = dict(m.named_parameters())
    rows = [
        torch.autograd.grad(sq(m(x[:, i : i + 1])), list(params.values())) for i in range(batch)
    ]
    with gradhooks.add_hooks(m, loss_reduction="sum", batch_dim=1):
        sq(m(x)).backward()
    for k, (n, p) in enumerate(params.items()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)


def test_batch_dim_names_where_the_models_batch_is():
    """A model that takes [seq, batch, features] and runs its layers batch-first: batch_dim=1
    says so. batch_dim=0 says the sequence is the batch, and grad1 is then per position
    (each position's own gradient: the layers treat positions alike)."""
    torch.manual_seed(0)
    inner = mlp()

    class SeqFirstInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = inner

        def forward(self, x):  # x: [seq, batch, 3]
            return self.net(x.transpose(0, 1))

    m = SeqFirstInput()
    x = torch.randn(4, 4, 3, dtype=D)  # seq 4, batch 4: sizes cannot tell them apart
    want = vmap_grad(inner, sq, x.transpose(0, 1))
    with gradhooks.add_hooks(m, batch_dim=1, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(inner, want, "batch_dim=1")
    per_position = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, batch_dim=0, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, per_position, "batch_dim=0")


class _Encoder(nn.Module):
    """Tokens plus a learned position embedding looked up with ``arange(T)``."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.proj = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 4)

    def forward(self, idx):
        return self.proj(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


class _TwoParts(nn.Module):
    """A model used through its parts: ``features`` (as CLIP's ``get_image_features``) calls
    its submodules, not its ``forward``."""

    def __init__(self):
        super().__init__()
        self.enc, self.head = _Encoder(), nn.Linear(4, 2)

    def features(self, idx):
        return self.head(self.enc(idx))

    def forward(self, idx):
        return self.features(idx)


ENTRIES = {
    "forward": lambda m, idx: m(idx),
    "method": lambda m, idx: m.features(idx),
    "submodule": lambda m, idx: m.enc(idx),
    "layer": lambda m, idx: m.head(m.enc.tok(idx)),
}


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
@pytest.mark.parametrize("how", list(ENTRIES))
def test_model_used_through_a_method_or_a_submodule(how, seq):
    """A model called through a method other than ``forward``, or a submodule called on its
    own: the batch is followed from that call's inputs as from the model's, so the position
    embedding gets each example's share, also with as many positions as examples."""
    torch.manual_seed(0)
    m = _TwoParts().double()
    idx = torch.randint(10, (3, seq))
    use = ENTRIES[how]
    params = dict(m.named_parameters())
    rows = [torch.autograd.grad(sq(use(m, idx[i : i + 1])), list(params.values()),
                                allow_unused=True) for i in range(3)]  # fmt: skip
    want = {n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(params.items())}  # fmt: skip
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(use(m, idx)).backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert_close(p.grad1, want[n], f"{how} {n}")


def test_a_layer_called_on_its_own_that_is_refused_leaves_no_forward_open():
    """A hooked layer called on its own whose capture is refused at its forward (batch
    statistics of a BatchNorm in training): the refusal ends that call's forward of the model,
    so that the next forward, of the whole model, is followed from its own inputs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'1' \(BatchNorm1d\)"):
            m[1](x @ torch.ones(3, 4, dtype=torch.float64))
        m.eval()
        z = torch.randn(5, 4, dtype=torch.float64)
        sq(m[2](z)).backward()  # (on its own again: its input is the batch)
        got = {n: p.grad1.clone() for n, p in m[2].named_parameters()}
        m.zero_grad(set_to_none=True)
        sq(m(x)).backward()
    for n, g in loop_grad(m[2], lambda out, *_: sq(out), z).items():
        assert_close(got[n], g, f"on its own: {n}")
    want = loop_grad(m, lambda out, *_: sq(out), x)
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_inputs_without_a_batch_dimension():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.UnbatchedInputError, match=r"no dimensions \(\(\)\): no batch.*unsqueeze"
        ):
            model(torch.tensor(1.0).expand(3)[0])
        out = model(torch.randn(3))  # [features]: torch accepts it, but it is no batch
        with pytest.raises(
            gradhooks.UnbatchedInputError,
            match=r"(?s).<model>. \(Linear\) got an input of shape \(3,\) without a batch.*"
            r"unsqueeze\(0\)",
        ):
            out.sum().backward()


# -- memory -------------------------------------------------------------------------------------


def test_grad1_too_large_is_refused_before_allocation():
    model = mlp()  # 32 parameters, float64: 256 bytes per example
    x = torch.randn(8, 3, dtype=D)
    with gradhooks.add_hooks(model, max_grad1_bytes=1000, batch_dim=0) as h:
        with pytest.raises(gradhooks.Grad1TooLarge) as e:
            model(x)  # batch_dim given: refused at the forward
        assert "2.0 KiB" in str(e.value) and "batch 8 × 32" in str(e.value)
        assert "quantities=('norms',)" in str(e.value) and "at most 3" in str(e.value)
        assert not h._state.frames
        sq(model(x[:3])).backward()  # 768 bytes: fine
        assert model[0].weight.grad1.shape == (3, 5, 3)
    gradhooks.clear_grad1(model)
    with gradhooks.add_hooks(model, max_grad1_bytes=1000) as h:
        out = model(x)  # batch_dim="auto": refused at the first captured call of the backward
        with pytest.raises(gradhooks.Grad1TooLarge, match="batch 8 × 32"):
            sq(out).backward()
        assert not h._state.tasks and not hasattr(model[0].weight, "grad1")
    with gradhooks.add_hooks(model, max_grad1_bytes=1000, quantities=("norms",)) as h:
        sq(model(x)).backward()  # norms never form grad1
        assert h.norms().shape == (8,)
    try:
        gradhooks.set_memory_limit(1000)
        with gradhooks.add_hooks(model):
            with pytest.raises(gradhooks.Grad1TooLarge):
                sq(model(x)).backward()
        with gradhooks.add_hooks(model, max_grad1_bytes=None):  # the handle's own wins
            sq(model(x)).backward()
        # a hooked module called on its own (no forward of the model): checked at its backward
        with gradhooks.add_hooks(model):
            with pytest.raises(gradhooks.Grad1TooLarge):
                model[0](x).sum().backward()
    finally:
        gradhooks.set_memory_limit("auto")
    assert gradhooks.engine.memory.memory_limit(torch.device("cpu")) > 2**20
    with pytest.raises(gradhooks.ConfigurationError, match="memory limit"):
        gradhooks.set_memory_limit(-1)


# -- an exception mid-forward or mid-backward leaves nothing behind -------------------------------


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.fail:
            raise RuntimeError("data error")
        return self.b(h)


def test_exception_in_the_forward_leaves_no_pending_capture():
    torch.manual_seed(0)
    m = Fails().double()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        m.fail = True
        with pytest.raises(RuntimeError, match="data error"):
            m(x)
        assert not h._state.collector._expected and not h._state.frames
        m.fail = False
        sq(m(x)).backward()
        assert_matches(m, want, "after a failed forward")
        norms = torch.cat([want[n].flatten(1) for n in want], 1).norm(dim=1)
        assert_close(h.norms(), norms, "norms after a failed forward")


class BoomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


def _registry_with_failing_linear(flag):
    linear = gradhooks.REGISTRY.lookup(nn.Linear(1, 1)).rule
    registry = gradhooks.Registry()

    @registry.register(nn.Linear)
    def maybe_failing(call):
        if flag[0] and call.name == "a":
            raise RuntimeError("rule failed in 'a'")
        return linear(call)

    return registry


@pytest.mark.parametrize("where", ["our hook", "elsewhere"])
def test_exception_in_the_backward_leaves_no_stale_state(where):
    torch.manual_seed(0)
    m = Fails().double()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    flag = [False]
    registry = _registry_with_failing_linear(flag)
    with gradhooks.add_hooks(
        m, loss_reduction="sum", quantities=("grad1", "norms"), registry=registry
    ) as h:
        sq(m(x)).backward()
        before = {n: p.grad1 for n, p in m.named_parameters()}
        if where == "our hook":  # 'b' is written, then the rule of 'a' raises
            flag[0] = True
            with pytest.raises(RuntimeError, match="rule failed in 'a'"):
                sq(m(x)).backward()
            flag[0] = False
        else:  # an op below the hooked layers raises after 'b''s hook ran
            h1 = torch.tanh(m.a(x))
            out = m.b(BoomBackward.apply(h1))
            with pytest.raises(RuntimeError, match="boom in backward"):
                sq(out).backward()
        m(x)  # the next forward drops whatever a failed backward left
        assert (
            not h._state.tasks and not h._state.collector._held and not h._state.collector._queued
        )
        for n, p in m.named_parameters():  # grad1 as before the failed backward
            assert_close(p.grad1, before[n], f"rolled back {n}")
        h.clear()
        sq(m(x)).backward()
        assert_matches(m, want, "after a failed backward")
        norms = torch.cat([want[n].flatten(1) for n in want], 1).norm(dim=1)
        assert_close(h.norms(), norms, "norms after a failed backward")


def test_check_flags_a_loss_that_couples_the_examples():
    """An InfoNCE loss: each example alone has a loss of 0 (nothing to contrast with), so the
    per-example recomputation has no gradient while grad1 does: check() says so."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=D)
    noise = 0.1 * torch.randn(6, 4, dtype=D)

    def info_nce(z, target=None):
        with gradhooks.paused():
            z2 = model(x[: z.shape[0]] + noise[: z.shape[0]]).detach()
        logits = F.normalize(z, dim=1) @ F.normalize(z2, dim=1).T
        return F.cross_entropy(logits / 0.1, torch.arange(z.shape[0]))

    with gradhooks.add_hooks(model) as h:
        info_nce(model(x)).backward()
        with pytest.raises(gradhooks.CheckFailedError, match="couples the examples"):
            h.check(info_nce, x)


# -- operations across the batch inside the forward ----------------------------------------------


def rowwise_grad(model, loss_rows, *inputs):
    """Each example's gradient from the batched graph itself (one backward per example's loss):
    the oracle where the forward computes something from the whole batch that no gradient flows
    through (data centred on the batch, a detached statistic, an index built from the batch)."""
    rows = loss_rows(model(*inputs))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per = [torch.autograd.grad(r, list(params.values()), retain_graph=True) for r in rows]
    return {n: torch.stack([g[k] for g in per]) for k, n in enumerate(params)}


def sq_rows(out):
    return 0.5 * out.pow(2).flatten(1).sum(1)


def spectral(h):
    """A round trip through the FFT along the features: each example on its own."""
    return torch.fft.ifft(torch.fft.fft(h, dim=1), dim=1).real


def unhandled(h):
    """An elementwise function the tracker has no handler for (the normal distribution's
    cumulative function): each example on its own, the examples presumed where they were."""
    return torch.special.ndtr(h)


MIXING = {
    "roll": lambda h: h + torch.roll(h, 1, 0),
    "mean": lambda h: h - h.mean(0),
    "batch-norm": lambda h: F.batch_norm(h, None, None, training=True),
    "gram": lambda h: (h @ h.T) @ h,
    "flip": lambda h: h.flip(0) * h,
    "cumsum": lambda h: h.cumsum(0),
    "pick": lambda h: h[[1, 0, 0, 3]],
    "permuted-sum": lambda h: h[[1, 0, 3, 2]] + h,
    "sorted-sum": lambda h: h.index_select(0, torch.tensor([3, 2, 1, 0])) * h,
    "gather": lambda h: h.gather(0, torch.zeros_like(h, dtype=torch.long)),
    # rows that are not examples put among them, then a shift, a sum or attention across rows
    "cat-shift": lambda h: torch.cat([h, torch.zeros(1, 5, dtype=D)])[1:] + h,
    "pad-shift": lambda h: F.pad(h, (0, 0, 1, 0))[:-1] + h,
    "cat-sum": lambda h: h + torch.cat([h, torch.ones(2, 5, dtype=D)]).mean(0),
    # after an operation the tracker has no handler for (the FFT): the examples presumed where
    # they were, so what mixes them there next is seen
    "fft-then-roll": lambda h: (lambda u: u + torch.roll(u, 1, 0))(spectral(h)),
    "fft-then-mean": lambda h: (lambda u: u - u.mean(0))(spectral(h)),
    # an operation without a handler along the batch, its dimension by keyword or position
    "fft-along-batch": lambda h: torch.fft.fft(h, dim=0).real,
    "fft-along-batch-positional": lambda h: torch.fft.fft(h, None, 0).real,
    # after an operation the tracker has no handler for, and one along the batch
    "fft2-over-batch": lambda h: torch.fft.fft2(h).real,
    "unhandled-then-roll": lambda h: (lambda u: u + torch.roll(u, 1, 0))(unhandled(h)),
    "unhandled-then-mean": lambda h: (lambda u: u - u.mean(0))(unhandled(h)),
    "unhandled-along-batch": lambda h: torch.special.softmax(h, dim=0),
    "unhandled-along-batch-positional": lambda h: torch.special.softmax(h, 0),
    "cat-attention": lambda h: (
        torch.softmax(h @ torch.cat([h, h[:1].detach() * 0]).T, -1)
        @ torch.cat([h, h[:1].detach() * 0])
    ),
}


@pytest.mark.parametrize("how", list(MIXING))
def test_forward_that_mixes_the_examples_is_refused(how):
    """An operation that makes one example's activations depend on another's (where a gradient
    flows back through it): per-example gradients of the layers after it do not exist, and the
    forward says which layer, its shapes and the operation."""
    torch.manual_seed(0)
    m = Between(MIXING[how]).double()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError,
            match=r"'l2' \(Linear\): its input \(\(4, 5\)\) was computed across",
        ):
            m(x)


class _Centred(torch.autograd.Function):
    """A custom function centring over the batch: forward and backward compute across it."""

    @staticmethod
    def forward(ctx, h):
        return h - h.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class _RowWise(torch.autograd.Function):
    """A custom function that keeps every example to itself (a scaled tanh)."""

    @staticmethod
    def forward(ctx, h):
        y = torch.tanh(h)
        ctx.save_for_backward(y)
        return 2 * y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 2 * g * (1 - y * y)


def _centring_hook(h):
    h = h * 1.0
    h.register_hook(lambda g: g - g.mean(0))
    return h


def _pairing_hook(h):
    """A gradient hook that mixes the first two examples' rows alone (none of the others)."""
    h = h * 1.0
    h.register_hook(lambda g: torch.cat([g[:1] + g[1:2], g[1:]]))
    return h


# Mixing the tracker does not see: only the first backward's check of one example against
# autograd's gradient from that example's rows of the output alone shows it
UNSEEN_MIXING = {
    "function": _Centred.apply,
    "backward-only": MixedBackward.apply,
    "gradient-hook": _centring_hook,
    "gradient-hook-first-two": _pairing_hook,
    "linalg-norm": lambda h: h / torch.linalg.norm(h),
    "layer-norm-over-batch": lambda h: F.layer_norm(h, h.shape),
    "cdist": lambda h: torch.cat([torch.cdist(h, h), h], 1)[:, :5],
    "pinv": lambda h: torch.linalg.pinv(h).t(),
    "conv-along-batch": lambda h: F.conv2d(
        h[None, None], torch.ones(1, 1, 3, 1, dtype=D), padding=(1, 0)
    )[0, 0],
    "transposed-reshape": lambda h: h.t().reshape(h.shape[0], h.shape[1]),
}


# (those the tracker sees mix: refused at the forward, where a layer reads them)
SEEN = ("function", "transposed-reshape", "cdist", "layer-norm-over-batch", "pinv")


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("how", list(UNSEEN_MIXING))
def test_mixing_the_tracker_cannot_see_is_refused_at_the_first_backward(how, reduction, quantity):
    """A custom autograd.Function, a gradient hook or an operation the tracker does not follow
    that computes across the batch: the first backward raises, naming the parameters whose
    grad1 (or norms) are not their examples' own, and keeps none."""
    torch.manual_seed(0)
    m = Between(UNSEEN_MIXING[how]).double()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction=reduction, quantities=(quantity,)) as h:
        if how in SEEN:  # (the tracker sees it mix)
            with pytest.raises(
                gradhooks.MixedExamplesError, match=r"'l2' \(Linear\): its input .* across the"
            ):
                m(x)
            return
        out = m(x)
        loss = sq(out) / (4 if reduction == "mean" else 1)
        with pytest.raises(
            gradhooks.CheckFailedError,
            match=r"(grad1 is not the examples' own|norms are not those of the examples').*'l1\.weight'",
        ):
            loss.backward()
        if quantity == "norms":
            with pytest.raises(gradhooks.StateError, match="no backward has been captured"):
                h.norms()
    assert not any(hasattr(p, "grad1") for p in m.parameters())


def _in_float32(how):
    """A detour through float32 inside the float64 model first (Hugging Face T5's attention
    softmax: ``.float()``, then ``.type_as``), then ``how``."""
    return lambda h: how(torch.softmax(h.float(), -1).type_as(h) * h)


# (those the tracker does not see mix: the probe alone finds them)
_PROBED = [k for k in UNSEEN_MIXING if k not in SEEN]


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("how", _PROBED)
def test_mixing_is_refused_in_a_float64_model_that_rounds_in_float32(how, quantity):
    """A float64 model that computes part of its forward in float32 is checked by the lowest
    precision it ran in (weights of powers of two, which carry each example's rows through
    float32 exactly): what mixes the examples unseen is still refused, naming the parameter;
    the same detour without the mixing is each example's own gradient (the float64 loop)."""
    torch.manual_seed(0)
    m = Between(_in_float32(UNSEEN_MIXING[how])).double()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)):
        with pytest.raises(
            gradhooks.CheckFailedError,
            match=r"(grad1 is not the examples' own|norms are not those of the examples').*'l1\.weight'",
        ):
            sq(m(x)).backward()
    assert not any(hasattr(p, "grad1") for p in m.parameters())
    m = Between(_in_float32(lambda h: h)).double()
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "float32 detour")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_custom_function_that_keeps_the_examples_apart(reduction):
    """A custom autograd.Function that treats each example alone: no refusal, each example's
    own gradient, at the first backward and after."""
    torch.manual_seed(0)
    m = Between(_RowWise.apply).double()
    x = torch.randn(4, 3, dtype=D)
    want = loop_grad(m, sq, x)  # (vmap needs the function's setup_context)
    with gradhooks.add_hooks(m, loss_reduction=reduction) as h:
        for _ in range(2):
            h.clear()
            sq(m(x)).div(4 if reduction == "mean" else 1).backward()
            assert_matches(m, want, "row-wise function")
    norms = torch.cat([g.reshape(4, -1) for g in want.values()], 1).norm(dim=1)
    with gradhooks.add_hooks(m, loss_reduction=reduction, quantities=("norms",)) as h:
        sq(m(x)).div(4 if reduction == "mean" else 1).backward()
        assert_close(h.norms(), norms, "row-wise function: norms")


@pytest.mark.parametrize(
    "how",
    [lambda h: unhandled(h) * h, lambda h: spectral(h) * h,
     lambda h: torch.special.softmax(h, 1) * h],
    ids=["unhandled", "fft", "unhandled-along-features"],
)  # fmt: skip
def test_operation_without_a_handler_keeps_each_example_apart(how):
    """An operation the tracker has no handler for (or the FFT along the features) between two
    layers: each example's gradient, as without it."""
    torch.manual_seed(0)
    m = Between(how).double()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "unhandled")


class _FFTConv(nn.Module):
    """Hyena's long convolution: a filter made by a layer from positions alone (batch-free),
    multiplied with the sequence in the frequency domain."""

    def __init__(self):
        super().__init__()
        self.filt, self.proj = nn.Linear(1, 4), nn.Linear(4, 4)

    def forward(self, x):  # [batch, seq, 4]
        t = x.shape[1]
        k = self.filt(torch.linspace(0, 1, t, dtype=x.dtype)[:, None])  # [seq, 4]
        u = self.proj(x)
        y = torch.fft.irfft(
            torch.fft.rfft(u, n=2 * t, dim=1) * torch.fft.rfft(k, n=2 * t, dim=0), n=2 * t, dim=1
        )
        return y[:, :t]


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
def test_convolution_in_the_frequency_domain(seq):
    torch.manual_seed(0)
    m = _FFTConv().double()
    x = torch.randn(3, seq, 4, dtype=D)
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "fft convolution")


def test_empty_rows_concatenated_keep_the_examples():
    """``cat([h, empty])`` along the batch (a cache of no rows yet) adds no rows: the examples
    stay where they were."""
    torch.manual_seed(0)
    m = Between(lambda h: torch.cat([torch.zeros(0, 5, dtype=D), h])).double()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "cat with no rows")


@pytest.mark.parametrize(
    "how, says",
    [
        # (the rows' examples followed through the layer; the model's output left in that
        # order, which a loss with targets would pair with another example's target)
        ("getitem", r"Between: its output .* in another order"),
        ("index_select", r"'l2' \(Linear\): .* in another order"),
    ],
)
def test_layer_on_reordered_examples_is_refused(how, says):
    """The examples in another order (``h[perm]``), to the model's output: refused at the
    forward, at the layer (``index_select``: its rule would give each example another's
    gradient) or at the output."""
    perm = torch.tensor([2, 0, 3, 1])
    reorder = {"getitem": lambda h: h[perm], "index_select": lambda h: h.index_select(0, perm)}
    torch.manual_seed(0)
    m = Between(reorder[how]).double()
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError, match=says):
            m(torch.randn(4, 3, dtype=D))


@pytest.mark.parametrize("how", ["centred-input", "detached-mean", "detached-roll"])
def test_batch_statistics_without_gradient_are_refused(how):
    """The same operations on what no gradient flows through (the data, a detached statistic):
    each example's result then depends on the others' data, so its gradient alone (the loop
    over batches of one) is not the batched forward's row. Refused at the forward, naming the
    layer, with the model untouched."""
    torch.manual_seed(0)
    mix = {
        "centred-input": lambda h: h,
        "detached-mean": lambda h: h - h.mean(0).detach(),
        "detached-roll": lambda h: h * torch.roll(h, 1, 0).detach(),
    }[how]

    class Model(Between):
        def forward(self, x):
            if how == "centred-input":
                x = x - x.mean(0)
            return super().forward(x)

    m = Model(mix).double()
    x = torch.randn(4, 3, dtype=D)
    rows, alone = rowwise_grad(m, sq_rows, x), loop_grad(m, sq, x)
    assert any(not torch.allclose(rows[n], alone[n]) for n in rows)  # (what was given before)
    layer = "l1" if how == "centred-input" else "l2"
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=rf"'{layer}' \(Linear\): its input .* across the"
        ):
            m(x)
    assert all(p.grad is None and not hasattr(p, "grad1") for p in m.parameters())


def test_sequence_first_model_read_batch_first_is_refused():
    """A model that takes [seq, batch, features] and averages over the sequence: with the
    default batch_dim, dimension 0 (the sequence) is taken as the batch, and the output, which
    averages over it, says so instead of giving grad1 a row per position."""
    torch.manual_seed(0)

    class SeqFirstMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):  # x: [seq, batch, 3]
            return self.net(x).mean(0)

    m = SeqFirstMean()
    x = torch.randn(5, 3, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"SeqFirstMean: its output \(\(3, 2\)\) mixes the 5"
                           r" examples.*batch_dim=k"):  # fmt: skip
            m(x)
    want = rowwise_grad(m, sq_rows, x)  # (the output's rows are the examples)
    with gradhooks.add_hooks(m, batch_dim=1, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "batch_dim=1")


class Indexed(nn.Module):
    """Indexing that keeps each example in its place: a per-example reordering of positions by
    ``h[arange(B)[:, None], order]``, a shifted copy written into a new buffer (as decoders
    shift their labels), a zero padding of the positions; then a layer run sequence-first."""

    def __init__(self, how):
        super().__init__()
        self.how, self.e, self.l, self.o = how, nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, order):
        h = self.e(x)
        if self.how == "gather-positions":
            h = h[torch.arange(x.shape[0])[:, None], order]
        elif self.how == "shifted-copy":
            s = h.new_zeros(h.shape)
            s[:, 1:] = h[:, :-1]
            h = s
        elif self.how == "mask-by-index":
            keep = (order < 3).double()[torch.arange(x.shape[0])[:, None], torch.arange(4)]
            h = h * keep[..., None]
        elif self.how == "pad-positions":
            h = F.pad(h, (0, 0, 1, 1))
        return self.o(torch.tanh(self.l(h.transpose(0, 1))).mean(0))


@pytest.mark.parametrize("how", ["gather-positions", "shifted-copy", "mask-by-index",
                                 "pad-positions"])  # fmt: skip
def test_indexing_that_keeps_the_examples_apart(how):
    """Batch 4 and sequence 4: only following the examples through the indexing tells the
    sequence-first layer which dimension holds them."""
    torch.manual_seed(0)
    m = Indexed(how).double()
    x = torch.randn(4, 4, 3, dtype=D)
    order = torch.stack([torch.randperm(4) for _ in range(4)])
    want = rowwise_grad(m, sq_rows, x, order)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, order)).backward()
    assert_matches(m, want, how)


def test_parameter_written_into_a_buffer_by_index():
    """A module without a rule that writes its parameter into a matrix (``M[rows, cols] = w``,
    as orthogonal fine-tuning adapters do) and multiplies the batch by it."""
    torch.manual_seed(0)

    class Skew(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(0.3 * torch.randn(1, 6))
            self.rows, self.cols = torch.triu_indices(4, 4, 1)

        def forward(self, x):
            m = torch.zeros(1, 4, 4, dtype=x.dtype)
            m[:, self.rows, self.cols] = self.weight
            return x @ (torch.eye(4, dtype=x.dtype) + m[0] - m[0].T)

    for frozen in (False, True):
        model = nn.Sequential(nn.Linear(3, 4), Skew(), nn.Linear(4, 2)).double()
        if frozen:
            model[0].requires_grad_(False)
            model[2].requires_grad_(False)
        x = torch.randn(5, 3, dtype=D)
        want = rowwise_grad(model, sq_rows, x)
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(x)).backward()
        for n, p in model.named_parameters():
            assert (n in want) == hasattr(p, "grad1"), n
            if n in want:
                assert_close(p.grad1, want[n], f"frozen={frozen} {n}")


def test_sequences_sorted_for_packing_and_back():
    """``pack_padded_sequence(..., enforce_sorted=False)`` sorts the examples by length
    (``index_select`` with a permutation) and the LSTM puts its final states back in the
    batch's order: a classifier on ``h_n[-1]`` gets each example's own gradient."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.out = (
                nn.Embedding(20, 5),
                nn.LSTM(5, 8, batch_first=True),
                nn.Linear(8, 3),
            )

        def forward(self, ids, lengths):
            packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                          enforce_sorted=False)  # fmt: skip
            _, (h, _) = self.rnn(packed)
            return self.out(h[-1])

    torch.manual_seed(0)
    m = Classifier().double()
    ids, lengths = torch.randint(20, (4, 6)), torch.tensor([3, 6, 2, 5])
    want = rowwise_grad(m, sq_rows, ids, lengths)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(ids, lengths)).backward()
    assert_matches(m, want, "unsorted packing")


def test_input_passed_by_keyword():
    """``layer(input=x)``: the rule reads the input where the forward's signature puts it."""
    torch.manual_seed(0)

    class ByKeyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(3, 4), nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(input=self.fc(input=x))

    m = ByKeyword().double()
    x = torch.randn(5, 3, dtype=D)
    want = vmap_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "keyword input")


@pytest.mark.parametrize("batch_dim", ["auto", 1])
def test_sequence_first_encoder_with_a_final_norm(batch_dim):
    """``nn.TransformerEncoder(..., norm=LayerNorm)`` with ``batch_first=False``, the sequence
    as long as the batch: the batch is taken from the encoder layer's own reading (dimension 1)
    before its operations run, so the final norm sees it there too."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, 0.0)
    m = nn.TransformerEncoder(layer, 1, norm=nn.LayerNorm(4), enable_nested_tensor=False).double()
    x = torch.randn(3, 3, 4, dtype=D)  # [seq, batch, features]
    want = {n: [] for n, _ in m.named_parameters()}
    for i in range(3):
        grads = torch.autograd.grad(sq(m(x[:, i : i + 1])), list(m.parameters()))
        for n, g in zip(want, grads):
            want[n].append(g)
    with gradhooks.add_hooks(m, loss_reduction="sum", batch_dim=batch_dim):
        sq(m(x)).backward()
    assert_matches(m, {n: torch.stack(g) for n, g in want.items()}, f"batch_dim={batch_dim}")


def test_verify_leaves_a_gradient_that_is_zero_but_for_rounding():
    """An InstanceNorm's scale under a summed output has gradient 0 (the normalized values sum
    to zero), which autograd and grad1 round differently: not a mismatch."""
    torch.manual_seed(0)
    m = nn.InstanceNorm1d(3, affine=True, bias=False).double()
    x = torch.randn(4, 3, 6, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        m(x).sum().backward()
    assert m.weight.grad1.abs().max() < 1e-12


class Prefixed(nn.Module):
    """Prefix tuning as PEFT does it: a table of virtual tokens looked up with positions
    expanded to the batch (batch-sized, but the same for every example), concatenated in front
    of the batch's keys by ``torch.cat([prefix, keys])``; ``twice``: the same prefix on both
    ends (one tensor in two places of the list)."""

    def __init__(self, twice=False):
        super().__init__()
        self.twice = twice
        self.prefix, self.k, self.o = nn.Embedding(2, 4), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        pos = torch.arange(2).unsqueeze(0).expand(x.shape[0], -1)
        pre = self.prefix(pos)  # [batch, 2, 4]
        keys = self.k(x)  # [batch, T, 4]
        parts = [pre, keys, pre] if self.twice else [pre, keys]
        h = torch.cat(parts, dim=1)
        return self.o(torch.tanh(h) * torch.tanh(h).sum(1, keepdim=True))


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_batch_free_prefix_concatenated_with_the_batch(twice):
    torch.manual_seed(0)
    m = Prefixed(twice).double()
    x = torch.randn(3, 5, 3, dtype=D)
    want = rowwise_grad(m, sq_rows, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "prefix")


@pytest.mark.parametrize("detached", [False, True], ids=["", "detached"])
@pytest.mark.parametrize("style", ["pre-hook", "parametrization"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_weight_norm_old_and_new(style, layer, detached):
    """The old ``nn.utils.weight_norm`` makes the layer's ``weight`` from ``weight_g`` and
    ``weight_v`` in a forward pre-hook, before the layer's call; the new one is a
    parametrization. Either way ``grad1`` is for the parameters the user trains.
    ``detached``: with the threshold at which Linear and convolution calls take their batch
    gradient from grad1 at 1 (as on long sequences); a call whose weight a pre-hook made
    before it is not run detached."""
    torch.manual_seed(0)
    first = nn.Linear(12, 4) if layer == "linear" else nn.Conv1d(3, 4, 3, padding=1)
    wrap = nn.utils.weight_norm if style == "pre-hook" else nn.utils.parametrizations.weight_norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the old one is deprecated)
        first = wrap(first)
    flat = nn.Flatten() if layer == "linear" else nn.Identity()
    model = nn.Sequential(flat, first, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    x = torch.randn(5, 3, 4, dtype=D)
    model(x)  # (the lazy layer's shape)
    want = rowwise_grad(model, sq_rows, x)
    threshold = 1 if detached else gradhooks.TUNING.sum_grad1_positions
    with gradhooks.tuned(sum_grad1_positions=threshold):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(x)).backward()
    assert_matches(model, want, f"{style} {layer}")
    if style == "pre-hook":
        with gradhooks.add_hooks(model, batch_dim=None, loss_reduction="sum"):
            with pytest.raises(
                gradhooks.RuleError, match=r"'weight_g'.*parametrizations.weight_norm"
            ):
                sq(model(x)).backward()


class _Experts(nn.Module):
    """Mixture-of-experts routing as Hugging Face writes it (Mixtral): each expert's weights a
    slice of one 3-d parameter, each token's rows picked by a data-dependent index, and put
    back with ``index_add_``; no rule, so the fallback recomputes it one example at a time."""

    def __init__(self, experts=3, dim=4, hidden=6):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) / 2)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) / 2)

    def forward(self, h, top, weights):  # h [tokens, dim], top / weights [tokens, k]
        out = torch.zeros_like(h)
        for e in range(self.up.shape[0]):
            token, slot = torch.where(top == e)
            rows = F.linear(torch.tanh(F.linear(h[token], self.up[e])), self.down[e])
            out.index_add_(0, token, rows * weights[token, slot, None])
        return out


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts, self.head = nn.Linear(4, 3), _Experts(), nn.Linear(4, 2)

    def forward(self, x):  # [batch, tokens, 4]
        flat = x.reshape(-1, 4)
        weights, top = self.router(flat).softmax(-1).topk(2, -1)
        return self.head(self.experts(flat, top, weights).view(x.shape))


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("tokens", [3, 5], ids=["tokens=batch", "tokens>batch"])
def test_mixture_of_experts_routing_each_token(tokens, quantity):
    """Rows of the batch picked by a data-dependent index and put back inside a module without
    a rule: the fallback recomputes it per example (which reproduces its output: routing is
    per token), so each example gets its own gradient."""
    torch.manual_seed(0)
    m = _MoE().double()
    x = torch.randn(3, tokens, 4, dtype=D)
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)) as h:
        sq(m(x)).backward()
    if quantity == "grad1":
        assert_matches(m, want, "experts")
    else:
        norms = torch.cat([g.reshape(3, -1) for g in want.values()], 1).norm(dim=1)
        assert_close(h.norms(), norms, "experts: norms")


def test_a_module_without_a_rule_that_truly_mixes_is_still_refused():
    """The same picking of rows, but each example's rows put back into another example's
    (a shift of the index): the per-example recomputation does not reproduce the output."""

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, h):  # [tokens, 4]
            idx = torch.where(h[:, 0] > -100)[0]
            out = torch.zeros_like(h)
            return out.index_add_(0, (idx + 3) % h.shape[0], F.linear(h[idx], self.w))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.head = Shifted(), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.mix(x.reshape(-1, 4)).view(x.shape))

    torch.manual_seed(0)
    m = Model().double()
    x = torch.randn(3, 3, 4, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.CheckFailedError,
            match="'mix.*(one example at a time does not reproduce|across the)",
        ):
            sq(m(x)).backward()
    assert not any(hasattr(p, "grad1") for p in m.parameters())


# -- parameters used outside their modules' calls: followed, or refused, never left out ---------


class Adapter(nn.Module):
    """A frozen layer and an adapter parameter held in a ParameterDict (never called itself), made
    into a matrix that multiplies the batch: ``how`` makes it like the batch, or loses the batch."""

    def __init__(self, how):
        super().__init__()
        self.how, self.base = how, nn.Linear(4, 4).requires_grad_(False)
        self.r = nn.ParameterDict({"a": nn.Parameter(0.3 * torch.randn(4, 4))})
        self.register_buffer("perm", torch.eye(4)[[1, 0, 3, 2]])

    def forward(self, x):
        h, r = self.base(x), self.r["a"]
        if self.how == "to":
            m = r.to(x) @ self.perm.to(x)  # (dtype and device like the batch)
        elif self.how == "type_as":
            m = r.type_as(h) @ self.perm.type_as(h)
        elif self.how == "view_as":
            m = r.reshape(-1).view_as(torch.empty(4, 4)).reshape_as(self.perm)
        elif self.how == "expand_as":
            return h * r[0].expand_as(h)
        else:  # the batch lost (an operation gradhooks does not know), then met
            return h.fliplr() @ r
        return h @ m


@pytest.mark.parametrize("how", ["to", "type_as", "view_as", "expand_as"])
def test_parameter_cast_like_the_batch(how):
    """``w.to(x)``, ``w.type_as(x)``, ``w.view_as(x)``, ``w.expand_as(x)`` take only the dtype,
    device or shape of the batch ``x``: the result holds ``w``'s values, the same for every
    example, and its per-example gradient is followed to where it meets the batch."""
    torch.manual_seed(0)
    model = Adapter(how).double()
    x = torch.randn(5, 4, dtype=D)
    want = rowwise_grad(model, sq_rows, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert list(want) == ["r.a"]
    assert_close(model.r.a.grad1, want["r.a"], how)


def test_parameter_whose_batch_is_lost_is_refused_at_the_backward():
    """A parameter used directly that meets a batch gradhooks lost the track of: the backward
    raises naming it and the operation, writes no grad1, and a DP step refuses too (it would
    clip the other parameters and leave this one untrained)."""
    torch.manual_seed(0)
    model = Adapter("lost").double()
    x = torch.randn(5, 4, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'r\.a' is used outside.*through fliplr"
        ):
            sq(model(x)).backward()
        assert not hasattr(model.r.a, "grad1")
        h.clear()
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'r\.a' is used outside.*through fliplr"
        ):
            gradhooks.dp_sgd_step(h, sq_rows(model(x)), max_norm=1.0, noise_multiplier=0.0)


class Penalized(nn.Module):
    """A parameter held outside any called module, whose only use is a penalty the model
    returns: its gradient is no example's."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(3, 2).requires_grad_(False)
        self.extra = nn.ParameterDict({"a": nn.Parameter(torch.randn(2))})

    def forward(self, x):
        return self.base(x), self.extra["a"].pow(2).sum()


def test_parameter_whose_gradient_never_meets_the_batch_is_refused():
    torch.manual_seed(0)
    model = Penalized().double()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out, penalty = model(torch.randn(4, 3, dtype=D))
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'extra\.a' is used outside.*never met the batch"
        ):
            (sq(out) + penalty).backward()
    assert not hasattr(model.extra.a, "grad1")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_step_refuses_a_parameter_without_per_example_gradients(method):
    """The forward run before add_hooks: the backward computes every gradient but captures none;
    the DP step refuses, naming the parameters, rather than clip nothing and step on zeros."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    losses = sq_rows(model(x))
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gradhooks.GradhooksWarning)
            with pytest.raises(
                gradhooks.StateError, match=r"dp_sgd_step: .*'0\.weight', '0\.bias'"
            ):
                gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)


# -- a 0-d parameter (a temperature, CLIP's logit_scale) times the batch ---------------------------


class Temperature(nn.Module):
    """Holds a 0-d parameter that its parent uses (never called itself)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.7))


class Scaled(nn.Module):
    """``tanh(a(x)) · exp(s)`` with ``s`` 0-d: the model's own parameter (``root``), or a
    submodule's that the model uses directly (``held``). With ``logits``, CLIP's: the scale
    multiplies ``v @ u.T``, ``[B, B]``, whose entries each depend on two examples."""

    def __init__(self, where, logits=False):
        super().__init__()
        self.where, self.logits = where, logits
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        if where == "root":
            self.scale = nn.Parameter(torch.tensor(0.7))
        else:
            self.temperature = Temperature()

    def forward(self, x):
        s = self.scale if self.where == "root" else self.temperature.scale
        if not self.logits:
            return self.b(torch.tanh(self.a(x))) * s.exp()
        u, v = self.a(x), self.b(x)
        return v @ u.T * s.exp(), u, v


@pytest.mark.parametrize("where", ["root", "held"])
def test_zero_dim_parameter_times_the_batch(where):
    torch.manual_seed(0)
    model = Scaled(where).double()
    x = torch.randn(5, 3, 4, dtype=D)
    want = vmap_grad(model, sq, x)
    for reduction in ("sum", "mean"):
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            loss = sq(model(x))
            (loss if reduction == "sum" else loss / 5).backward()
        assert_matches(model, want, f"{where} {reduction}")
        gradhooks.clear_grad1(model)
    # its per-example norms, and a DP step on them (a [batch] grad1, no feature dimension)
    norms = torch.cat([g.reshape(5, -1) for g in want.values()], 1).norm(dim=1)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        sq(model(x)).backward()
        assert_close(h.norms(), norms, "norms")
        got = gradhooks.dp_sgd_step(
            h, sq_rows(model(x)), max_norm=1e9, noise_multiplier=0.0, reduction="sum"
        )
    assert_close(got, norms, "dp_sgd_step's norms")
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n].sum(0), f"dp_sgd_step {n}")


def test_zero_dim_parameter_times_logits_across_the_batch_is_refused():
    """CLIP's logits ``[B, B]`` times ``exp(logit_scale)``: each entry depends on two examples,
    so the scale has no per-example gradient. Refused, naming the parameter or the module, as
    the model returns the logits alone or with per-example outputs."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=D)
    model = Scaled("held", logits=True).double()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        logits, u, v = model(x)
        with pytest.raises(
            gradhooks.UnsupportedError,
            match=r"'temperature\.scale' is used outside.*'mul' combines it with a tensor whose "
            r"entries depend on several examples at once \(matmul\)",
        ):
            logits.diagonal().sum().backward()
    assert not hasattr(model.temperature.scale, "grad1")
    model = Scaled("root", logits=True).double()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        logits, u, v = model(x)
        with pytest.raises(
            gradhooks.UnsupportedInputError, match=r"fallback for '<model>' \(Scaled\).*\(3, 3\)"
        ):
            logits.diagonal().sum().backward()

    class LogitsOnly(Scaled):
        def forward(self, x):
            return super().forward(x)[0]

    model = LogitsOnly("root", logits=True).double()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"LogitsOnly: its output \(\(3, 3\)\) mixes the 3"
        ):
            model(x)


# -- max and min: elementwise of two tensors, a reduction along a dimension ----------------------


def layout_after(fn, x, layout, *args, **kwargs):
    """The layout the tracker gives ``fn(x, *args, **kwargs)`` (its first tensor), ``x``
    having ``layout``."""
    tracker = Tracker(x.shape[layout.dim], {})
    tracker.set_layout(x, layout)
    with tracker:
        out = fn(x, *args, **kwargs)
    return tracker.layout(out[0] if isinstance(out, tuple) else out)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("how", ["mask", "slice"])
def test_rows_regrouped_across_the_examples_are_refused_at_the_forward(how, checkpointed):
    """Each example's two rows ``[B * 2, F]`` viewed as ``[2, B, F]`` and averaged: a row of
    the result holds two examples' entries. Refused at the forward, also where the first
    backward's check is left out (activation checkpointing, ``verify=False``)."""
    from torch.utils.checkpoint import checkpoint

    class Regroup(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)

        def block(self, x, mask):
            h = torch.tanh(self.l1(x))
            rows = h[mask] if how == "mask" else h[:, 1:3].reshape(x.shape[0] * 2, 6)
            return rows.view(2, x.shape[0], 6).mean(0)

        def forward(self, x, mask):
            if checkpointed:
                return self.l2(checkpoint(self.block, x, mask, use_reentrant=False))
            return self.l2(self.block(x, mask))

    torch.manual_seed(0)
    m = Regroup().double()
    x, mask = torch.randn(3, 4, 4, dtype=D), torch.zeros(3, 4, dtype=torch.bool)
    mask[:, 1:3] = True
    with gradhooks.add_hooks(m, loss_reduction="sum", verify=checkpointed):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'l2' \(Linear\): its input .* across the"
        ):
            sq(m(x, mask)).backward()
    assert not any(hasattr(p, "grad1") for p in m.parameters())


def test_rows_picked_with_an_arange_over_folded_heads_stay_in_place():
    """Informer's sparse attention: ``q[arange(B * H)[:, None], top]`` picks, for every row
    of the folded batch and heads, its own queries: the layout stays; heads swapped within
    each example keep it too (each row is still its example's)."""
    x = torch.randn(4, 3, 5, dtype=D, requires_grad=True)  # 2 examples x 2 heads
    top = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    for rows, want in ((torch.arange(4)[:, None], Layout(0, inner=2)),
                       (torch.tensor([1, 0, 3, 2])[:, None], Layout(0, inner=2))):  # fmt: skip
        tracker = Tracker(2, {})
        tracker.set_layout(x, Layout(0, inner=2))
        with tracker:
            out = x[rows, top]
        assert tracker.layout(out) == want


LIKE_THE_INPUT = {
    "max(x, 0-d)": lambda x: torch.max(x, torch.tensor(-0.5, dtype=D)),
    "min(x, other=row)": lambda x: torch.min(x, other=torch.zeros(x.shape[-1], dtype=D)),
    "x.max(x.flip(-1))": lambda x: x.max(x.flip(-1)),
    "max(0-d, x)": lambda x: torch.max(torch.tensor(0.1, dtype=D), x),
}


@pytest.mark.parametrize("how", list(LIKE_THE_INPUT))
@pytest.mark.parametrize("layout", [Layout(0), Layout(1)], ids=["batch-first", "batch-second"])
def test_max_min_of_two_tensors_is_elementwise(how, layout):
    x = torch.randn(3, 4, 5, dtype=D, requires_grad=True)
    assert layout_after(LIKE_THE_INPUT[how], x, layout) == layout


def test_max_min_along_a_dimension_is_a_reduction_along_it():
    x = torch.randn(3, 4, 5, dtype=D, requires_grad=True)
    for fn in (torch.max, torch.min, torch.amax, torch.Tensor.max):
        assert layout_after(fn, x, Layout(0), 2) == Layout(0)
        assert layout_after(fn, x, Layout(1), 0) == Layout(0)
        assert layout_after(fn, x, Layout(1), -1, keepdim=True) == Layout(1)
        assert layout_after(fn, x, Layout(2), dim=1) == Layout(1)
        assert layout_after(fn, x, Layout(0), 0) is MIXED
    assert layout_after(lambda x: x.max(dim=1).indices, x, Layout(0)) == Layout(0)
    assert layout_after(torch.max, x, Layout(0)) is MIXED
    assert layout_after(lambda x: x.min(), x, Layout(1)) is MIXED


class Clamped(nn.Module):
    """Elementwise max and min with a 0-d tensor (XGLM's clamp of its attention scores), and a
    max over the sequence (pooling), between two layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.max(self.a(x), torch.tensor(-0.5, dtype=x.dtype))
        h = h.min(torch.tensor(0.8, dtype=x.dtype))
        return self.b(h.max(dim=1).values)


def test_max_min_between_layers_match_the_oracle():
    torch.manual_seed(0)
    model = Clamped().double()
    x = torch.randn(5, 6, 4, dtype=D)
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_matches(model, want, "clamped")


# -- operations the tracker follows the batch through -----------------------------------------

A_SQUARE = torch.eye(4, dtype=D) + 0.1 * torch.ones(4, 4, dtype=D)

FOLLOWED = {
    # (operation, input layout, the output's)
    "repeat_interleave along the batch": (
        lambda x: x.repeat_interleave(2, dim=0),
        Layout(0),
        Layout(0, inner=2),
    ),
    "repeat_interleave along another": (
        lambda x: x.repeat_interleave(3, dim=2),
        Layout(1),
        Layout(1),
    ),
    "view_as_complex": (
        lambda x: torch.view_as_complex(x.reshape(3, 4, 2, 2)),
        Layout(0),
        Layout(0),
    ),
    "view_as_real": (
        lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(3, 4, 2, 2))),
        Layout(0),
        Layout(0),
    ),  # fmt: skip
    "solve_triangular": (
        lambda x: torch.linalg.solve_triangular(A_SQUARE.expand(3, 4, 4), x, upper=False),
        Layout(0),
        Layout(0),
    ),  # fmt: skip
    "log_sigmoid": (F.logsigmoid, Layout(1), Layout(1)),
    "polar": (lambda x: torch.view_as_real(torch.polar(x.exp(), x)), Layout(1), Layout(1)),
    "unfold by keyword": (lambda x: x.unfold(dimension=-1, size=2, step=2), Layout(0), Layout(0)),
    "diagonal of the last two": (lambda x: x.diagonal(0, 1, 2), Layout(0), Layout(0)),
    "diagonal by keyword": (lambda x: x.diagonal(dim1=-2, dim2=-1), Layout(0), Layout(0)),
    "diagonal before the batch": (lambda x: x.diagonal(0, 0, 2), Layout(1), Layout(0)),
    "diagonal across the batch": (lambda x: x.diagonal(), Layout(0), MIXED),
    "unfold (im2col)": (lambda x: F.unfold(x[:, None], (2, 2)), Layout(0), Layout(0)),
}


@pytest.mark.parametrize("how", list(FOLLOWED))
def test_operations_the_batch_is_followed_through(how):
    fn, before, after = FOLLOWED[how]
    x = torch.randn(3, 4, 4, dtype=D, requires_grad=True)
    assert layout_after(fn, x, before) == after


# -- the first backward's check: what it must not refuse, what it must see ----------------------


class _MeanScaled(nn.Module):
    """Hugging Face's time-series mean scaler: each series scaled by its mean absolute
    observed value; a scale from the whole batch only where a series has no observation."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, observed):
        total = (x * observed).abs().sum(1, keepdim=True)
        count = observed.sum(1, keepdim=True)
        scale = total / count.clamp(min=1)
        default = (total.sum(0) / count.sum(0).clamp(min=1)).squeeze()  # across the batch
        return self.lin(x / torch.where(count > 0, scale, default))


def test_a_batch_statistic_that_no_entry_takes_is_not_mixing():
    """Every series observed: ``torch.where`` takes none of the batch's scale, each example is
    its own (the loop agrees). One series unobserved: it takes it, and is refused."""
    torch.manual_seed(0)
    m = _MeanScaled().double()
    x, observed = torch.randn(3, 4, dtype=D), torch.ones(3, 4, dtype=D)
    want = loop_grad(m, sq, (x, observed))
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, observed)).backward()
    assert_matches(m, want, "every series observed")
    observed[1] = 0
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'lin' \(Linear\): its input .* across the"
        ):
            m(x, observed)


class _InsideAFunction(torch.autograd.Function):
    """A parameter combined with the batch inside a custom function's forward (PEFT's C3A
    block-circular convolution): autograd records no graph there."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.fft.ifft(torch.fft.fft(x) * torch.fft.fft(w)).real

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gf = torch.fft.fft(g)
        gx = torch.fft.ifft(gf * torch.fft.fft(w).conj()).real
        gw = torch.fft.ifft((gf * torch.fft.fft(x).conj()).sum(0)).real
        return gx, gw


@pytest.mark.parametrize("verify", [True, False])
def test_a_parameter_combined_with_the_batch_inside_a_custom_function_is_refused(verify):
    class Circular(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(4, 4)
            self.kernel = nn.ParameterDict({"w": nn.Parameter(torch.randn(4))})  # (as PEFT)

        def forward(self, x):
            return self.base(x) + _InsideAFunction.apply(x, self.kernel["w"])

    torch.manual_seed(0)
    m = nn.Sequential(Circular(), nn.Linear(4, 2)).double()
    with gradhooks.add_hooks(m, loss_reduction="sum", verify=verify):
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'0\.kernel\.w' .* custom autograd\.Function"
        ):
            sq(m(torch.randn(3, 4, dtype=D))).backward()
    assert not any(hasattr(p, "grad1") for p in m.parameters())


class _AddedInPlace(nn.Module):
    """Layers whose inputs do not depend on the examples, added in place into the batch:
    TAPAS's token-type lookups of all-zero ids ``[B, T]``, and MPNet's relative bias,
    expanded to the batch and made contiguous, added to the scores."""

    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)
        self.types = nn.ModuleList([nn.Embedding(3, 4) for _ in range(2)])
        self.bias = nn.Embedding(9, 4)

    def forward(self, x):
        b, t = x.shape
        h = self.tok(x)
        types = torch.zeros(b, t, 2, dtype=torch.long)
        for i, table in enumerate(self.types):
            h += table(types[:, :, i])
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None] + 4  # [T, T]
        bias = self.bias(rel.clamp(0, 8)).permute(2, 0, 1).unsqueeze(0)  # [1, 4, T, T]
        scores = torch.einsum("bsf,buf->bsu", h, h)[:, None].repeat(1, 4, 1, 1)
        scores += bias.expand(b, -1, t, t).contiguous()
        return self.head(torch.einsum("bfsu,buf->bsf", scores.softmax(-1), h))


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_layers_without_the_examples_added_in_place_into_the_batch(seq, reduction):
    torch.manual_seed(0)
    m = _AddedInPlace().double()
    x = torch.randint(0, 10, (3, seq))
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction=reduction):
        sq(m(x)).div(3 if reduction == "mean" else 1).backward()
    assert_matches(m, want, "added in place")


class _Into(nn.Module):
    """The other way round: the batch written into the lookup's output (``table(ids) += h``)."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(8, 4), nn.Linear(4, 2)

    def forward(self, x):
        p = self.pos(torch.arange(x.shape[1])).expand(x.shape[0], -1, -1).contiguous()
        p += self.tok(x)
        return self.head(p)


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_batch_added_in_place_into_a_layer_without_the_examples(seq, reduction):
    """Each example's share of the lookup's output is its rows of the result's gradient (the
    gradient of ``p`` before ``+=`` is the result's): refused before, now the loop's."""
    torch.manual_seed(0)
    m = _Into().double()
    x = torch.randint(0, 10, (3, seq))
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction=reduction):
        sq(m(x)).div(3 if reduction == "mean" else 1).backward()
    assert_matches(m, want, "the batch added in place")


class _ActNorm(nn.Module):
    """normflows' ActNorm, inverted: its parameters used in a method besides its forward, its
    log-determinant a number of no example."""

    def __init__(self):
        super().__init__()
        self.s, self.t = nn.Parameter(torch.randn(1, 4)), nn.Parameter(torch.randn(1, 4))

    def inverse(self, z):
        return (z - self.t) * torch.exp(-self.s), -self.s.sum()


class _Coupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 4)

    def inverse(self, z):
        h = self.net(z)
        return z + h, h.sum(1)


class _LogDensity(nn.Module):
    """A normalizing flow's log-density as normflows sums it: ``log_q = zeros(len(x))``, each
    layer's log-determinant added in place (``a``: an ActNorm, ``c``: a coupling)."""

    def __init__(self, order: str, subtract: bool = False):
        super().__init__()
        self.subtract = subtract
        self.flows = nn.ModuleList([_ActNorm() if k == "a" else _Coupling() for k in order])

    def forward(self, x):
        log_q, z = torch.zeros(len(x), dtype=x.dtype), x
        for flow in self.flows:
            z, log_det = flow.inverse(z)
            if self.subtract:
                log_q -= -log_det
            else:
                log_q += log_det
        return log_q - 0.5 * z.pow(2).sum(1)


@pytest.mark.parametrize("order", ["ac", "ca", "aca", "caac"])
@pytest.mark.parametrize("subtract", [False, True], ids=["+=", "-="])
def test_the_batch_added_in_place_into_a_sum_of_a_parameter(order, subtract):
    """With an ActNorm first, ``log_q`` holds a number computed from its parameter alone when
    the batch is added into it in place (``+=`` or ``-=``): refused before ("the in-place
    'add_' writes the batch into a tensor derived from it"), now the loop's. With a coupling
    first, the ActNorm's number is added into the batch (as before)."""
    torch.manual_seed(0)
    m = _LogDensity(order, subtract).double()
    x = torch.randn(3, 4, dtype=D)
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, order)


class _PositionsExpandedFirst(nn.Module):
    """Flaubert's positions: ``[1, T]`` expanded to ``[B, T]`` before the table, whose output
    (already ``[B, T, D]``) is then expanded to the tokens' shape, a no-op."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.norm = nn.Embedding(10, 4), nn.Embedding(8, 4), nn.LayerNorm(4)
        self.register_buffer("ids", torch.arange(8)[None], persistent=False)

    def forward(self, x):
        b, t = x.shape
        tokens = self.tok(x)
        return self.norm(tokens + self.pos(self.ids[:, :t].expand(b, t)).expand_as(tokens))


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
def test_position_ids_expanded_to_the_batch_before_the_table(seq):
    torch.manual_seed(0)
    m = _PositionsExpandedFirst().double()
    x = torch.randint(0, 10, (3, seq))
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x)).backward()
    assert_matches(m, want, "positions expanded first")


class _PooledToo(nn.Module):
    """Returns a tensor and a row of it (``last_hidden_state`` and a pooled output)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        s = self.a(x)
        return s, s[:, 0]


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_outputs_computed_from_each_other_are_not_refused(quantity):
    """The loss uses both outputs; the gradient reaching the first holds what flowed in
    through the second: the check leaves such outputs out rather than count it twice."""
    torch.manual_seed(0)
    m = _PooledToo().double()
    x = torch.randn(3, 5, 4, dtype=D)
    loss = lambda out: sq(out[0]) + sq(out[1])
    want = loop_grad(m, loss, x)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)) as h:
        loss(m(x)).backward()
    if quantity == "grad1":
        assert_matches(m, want, "pooled too")
    else:
        norms = torch.cat([g.reshape(3, -1) for g in want.values()], 1).norm(dim=1)
        assert_close(h.norms(), norms, "pooled too: norms")


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_a_backward_for_some_parameters_only(how, quantity):
    torch.manual_seed(0)
    m = mlp()
    x = torch.randn(4, 3, dtype=D)
    want = vmap_grad(m, sq, x)["2.weight"]
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)) as h:
        loss = sq(m(x))
        if how == "autograd.grad":
            torch.autograd.grad(loss, [m[2].weight])
        else:
            loss.backward(inputs=[m[2].weight])
        if quantity == "grad1":
            assert_close(m[2].weight.grad1, want, how)
        else:
            assert_close(h.param_norms()["2.weight"], want.flatten(1).norm(dim=1), how)


def _swap_first_two(h):
    """A gradient hook that swaps examples 0 and 1 of the gradient, the last left alone."""
    h = h * 1.0
    h.register_hook(lambda g: g[[1, 0, *range(2, g.shape[0])]])
    return h


def test_mixing_that_leaves_the_last_example_alone_is_refused():
    """The check weighs every example (not only the last): a gradient hook that swaps the
    first two examples' rows is seen."""
    torch.manual_seed(0)
    m = Between(_swap_first_two).double()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.CheckFailedError, match=r"grad1 is not the examples' own.*'l1\.weight'"
        ):
            sq(m(x)).backward()


@pytest.mark.parametrize("equal", [True, False], ids=["as-many-each", "unequal"])
def test_rows_picked_by_a_boolean_mask_over_the_batch(equal):
    """``h[mask]`` with a boolean mask over ``[batch, seq]`` (end-of-sequence pooling, patches
    kept): the rows come example by example; with as many per example they are followed as a
    fold, with some examples having more than others as rows each owned by one example (the
    unpadded tokens of a batch)."""
    torch.manual_seed(0)

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x, mask):
            h = torch.tanh(self.a(x))[mask, :]
            return self.b(h.view(x.shape[0], -1, 5)[:, -1] if equal else h)

    m = Pool().double()
    x = torch.randn(3, 4, 3, dtype=D)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[:, [1, 3]] = True
    if not equal:
        mask[0, 0] = True
    want = loop_grad(m, sq, (x, mask))
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, mask)).backward()
    assert_matches(m, want, "masked rows")


def test_norms_refused_where_a_parameter_was_used_outside_the_model():
    """A parameter the loss uses directly (CLIP's ``logit_scale`` in the user's loss): its
    per-example gradient is not captured, so the whole-model norms are refused rather than
    left without it (a warning says which); the others' norms stay readable."""
    torch.manual_seed(0)
    m = mlp()
    scale = nn.Parameter(torch.tensor(1.5, dtype=D))
    m.register_parameter("scale", scale)
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=("norms",)) as h:
        with pytest.warns(gradhooks.GradhooksWarning, match="'scale'"):
            sq(m(x) * scale).backward()
        with pytest.raises(gradhooks.StateError, match="gradient of 'scale' but captured no"):
            h.norms()
        assert set(h.param_norms()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


class _MaskedAttention(nn.Module):
    """A causal mask ``[T, T]`` passed beside the batch, added to the scores as it is."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(1, 2) + mask
        return self.o(scores.softmax(-1) @ x)


@pytest.mark.parametrize("seq", [3, 5], ids=["seq=batch", "seq>batch"])
def test_a_shared_input_as_long_as_the_batch(seq):
    """The mask's first dimension has the batch's size when the sequence is as long as the
    batch: taken as batched by its size, it would make the sum mix the examples; taken as shared
    instead, the sum keeps them apart, and each example gets its own gradient."""
    torch.manual_seed(0)
    m = _MaskedAttention().double()
    x = torch.randn(3, seq, 4, dtype=D)
    mask = torch.triu(torch.full((seq, seq), -1e9, dtype=D), 1)
    params = dict(m.named_parameters())
    rows = [torch.autograd.grad(sq(m(x[i : i + 1], mask)), list(params.values())) for i in range(3)]
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, mask)).backward()
    for k, (n, p) in enumerate(params.items()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)


def test_a_change_after_the_first_steps_is_seen_at_the_next_check():
    """What changes after the first backward without changing the layer calls (a gradient hook
    added, a term added to the loss) is checked again at the 2nd, 4th, 8th... backward: it is
    refused there, not accepted for good."""
    torch.manual_seed(0)
    m = mlp()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum") as h:
        sq(m(x)).backward()  # the 1st backward, checked: right
        h.clear()
        out = m(x)
        with pytest.raises(gradhooks.CheckFailedError, match="does not add up.*'0.weight'"):
            (sq(out) + 0.1 * m[0].weight.pow(2).sum()).backward()  # the 2nd: checked again
        checked = [k for k in range(1, 9) if k & (k - 1) == 0]
        assert checked == [1, 2, 4, 8]


class ConvOfATable(nn.Module):
    """A convolution of a fixed table, the same for every example, added to the batch: the
    convolution reads its batch from dimension 0, so its rule runs once per example with that
    example's share of the output-gradient."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(1, 2, 8))
        self.conv, self.out = nn.Conv1d(2, 2, 3, padding=1), nn.Linear(8, 2)

    def forward(self, x):  # [batch, 2, 8]
        return self.out(torch.tanh(x + self.conv(self.table)))


def test_batch_free_call_of_a_layer_with_a_fixed_batch_dimension():
    torch.manual_seed(0)
    model = ConvOfATable().double()
    x = torch.randn(4, 2, 8, dtype=D)
    want = rowwise_grad(model, sq_rows, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_matches(model, want, "conv of a table")


class TanhPositions(Positions):
    """A position embedding through a batch-free operation before it meets the batch."""

    def forward(self, x):
        return self.l(x + torch.tanh(self.pos(torch.arange(x.shape[1]))))


def test_batch_free_gradients_one_example_at_a_time(monkeypatch):
    """Where autograd cannot batch the backward through the batch-free operations (an
    operation with no batching rule: ``is_grads_batched`` raises), each example's share is
    taken back through them one example at a time, to the same numbers."""
    torch.manual_seed(0)
    model = TanhPositions().double()
    x = torch.randn(5, 4, 3, dtype=D)
    want = rowwise_grad(model, sq_rows, x)
    real, refused = torch.autograd.grad, []

    def grad(*args, is_grads_batched=False, **kwargs):
        if is_grads_batched:
            refused.append(True)
            raise RuntimeError("no batching rule")
        return real(*args, **kwargs)

    with gradhooks.add_hooks(model, loss_reduction="sum", verify=False):
        monkeypatch.setattr(torch.autograd, "grad", grad)
        sq(model(x)).backward()
    assert refused
    assert_matches(model, want, "one by one")

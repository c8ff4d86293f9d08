"""Sizes never decide: a batch as long as a shared input, batch sizes that change from step to
step, and batches without examples, on dimension 0 or another. Each is checked against the
float64 per-example loop (example ``i`` being ``x.narrow(batch_dim, i, 1)``, every shared input
as it is), or refused with an error naming the module, the parameter and the shapes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gradhooks
from harness import assert_close

D = torch.float64


def sq(out) -> Tensor:
    return 0.5 * out.pow(2).sum()


def loop_rows(model: nn.Module, x: Tensor, *shared, dim: int = 0) -> dict[str, Tensor]:
    """The float64 per-example loop: example ``i`` is ``x.narrow(dim, i, 1)``, with every
    ``shared`` input as it is."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[dim]):
        out = model(x.narrow(dim, i, 1), *shared)
        rows.append(torch.autograd.grad(sq(out), list(named.values()), allow_unused=True))
    return {
        n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        if rows else p.new_zeros((0, *p.shape))
        for k, (n, p) in enumerate(named.items())
    }  # fmt: skip


# -- batches without examples -----------------------------------------------------------------


def _emb() -> nn.Module:
    return nn.Embedding(5, 3)


class _EmbLSTM(nn.Module):
    """Opacus' embedding test, sequence-first: tokens ``[time, batch]``, then an LSTM."""

    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.out = nn.Embedding(5, 3), nn.LSTM(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


EMPTY = {
    "embedding [T, 0]": (_emb, lambda t: torch.zeros(t, 0, dtype=torch.long)),
    "embedding [T, 0, Q]": (_emb, lambda t: torch.zeros(t, 0, 2, dtype=torch.long)),
    "linear [T, 0, F]": (lambda: nn.Linear(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "lstm [T, 0, F]": (lambda: nn.LSTM(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "rnn [T, 0, F]": (lambda: nn.RNN(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "embedding-lstm [T, 0]": (_EmbLSTM, lambda t: torch.zeros(t, 0, dtype=torch.long)),
}


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("time", [1, 3], ids=["T=1", "T=3"])
@pytest.mark.parametrize("case", list(EMPTY))
def test_no_example_on_dimension_1(case, time, quantity):
    """``batch_dim=1`` and a batch of 0 (``[T, 0, ...]``): grad1 ``[0, *p.shape]`` (norms
    ``[0]``), as for an empty batch on dimension 0, whatever dimension the layers read."""
    make, inputs = EMPTY[case]
    torch.manual_seed(0)
    m = make().double()
    x = inputs(time)
    with gradhooks.add_hooks(m, batch_dim=1, quantities=(quantity,)) as h:
        out = m(x)
        sq(out[0] if isinstance(out, tuple) else out).backward()
        for n, p in m.named_parameters():
            if quantity == "grad1":
                assert_close(p.grad1, p.new_zeros((0, *p.shape)), f"{case} {n}")
            else:
                assert h.param_norms()[n].shape == (0,), f"{case} {n}"


@pytest.mark.parametrize("time", [1, 3], ids=["T=1", "T=3"])
@pytest.mark.parametrize("case", ["embedding [T, 0]", "linear [T, 0, F]", "embedding-lstm [T, 0]"])
def test_an_empty_first_input_is_not_taken_for_examples(case, time):
    """``batch_dim="auto"`` on ``[T, 0, ...]`` (dimension 0 as the batch, the layers' rows
    counting ``T`` examples without entries): refused, saying to name the batch dimension;
    never ``T`` rows of zeros taken for examples."""
    make, inputs = EMPTY[case]
    m = make().double()
    with (
        gradhooks.add_hooks(m),
        pytest.raises(gradhooks.UnbatchedInputError, match=r"no entries.*batch_dim=k"),
    ):
        out = m(inputs(time))
        sq(out[0] if isinstance(out, tuple) else out).backward()
    assert all(not hasattr(p, "grad1") for p in m.parameters())


@pytest.mark.parametrize("case", ["embedding [T, 0]", "linear [T, 0, F]"])
def test_examples_without_entries_on_dimension_0(case):
    """``batch_dim=0`` on ``[B, 0, ...]``: ``B`` examples without entries, each with a zero
    gradient, as the per-example loop gives (was: a reshape error in the Linear's piece)."""
    make, inputs = EMPTY[case]
    m = make().double()
    x = inputs(3)
    want = loop_rows(m, x)
    with gradhooks.add_hooks(m, batch_dim=0, loss_reduction="sum"):
        sq(m(x)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], f"{case} {n}")


# -- a shared input as long as the batch ------------------------------------------------------


class _Prototypes(nn.Module):
    """A few-shot model: prototypes encoded from a memory ``[K, F]`` (a buffer, or the forward's
    second argument), logits the negative distances ``-cdist(encoder(x), prototypes)``."""

    def __init__(self, k: int):
        super().__init__()
        self.encoder, self.proto_encoder = nn.Linear(3, 4), nn.Linear(4, 4)
        self.register_buffer("memory", torch.randn(k, 4))

    def forward(self, x, memory=None):
        memory = self.memory if memory is None else memory
        return -torch.cdist(self.encoder(x), self.proto_encoder(memory))


class _DeepPrototypes(_Prototypes):
    """The same, the prototypes encoded by two hooked layers (``Linear``, ``tanh``, ``Linear``):
    a memory as long as the batch is taken as shared only where the second layer's output
    meets the examples, after both calls ran as batched."""

    def __init__(self, k: int):
        super().__init__(k)
        self.proto_encoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


class _RectifiedPrototypes(_Prototypes):
    """Two layers with ``relu_`` between them, in place on the first layer's output."""

    def __init__(self, k: int):
        super().__init__(k)
        self.proto_encoder = nn.Linear(4, 4)
        self.proto_out = nn.Linear(4, 4)

    def forward(self, x, memory=None):
        memory = self.memory if memory is None else memory
        hidden = self.proto_encoder(memory).relu_()
        return -torch.cdist(self.encoder(x), self.proto_out(hidden))


class _PrototypeTable(nn.Module):
    """``K`` prototypes in an ``nn.Embedding``, looked up with ``arange(K)`` (made here, or
    passed as the forward's second argument), scored by a dot product."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.encoder, self.protos = k, nn.Linear(3, 4), nn.Embedding(k, 4)

    def forward(self, x, ids=None):
        ids = torch.arange(self.k) if ids is None else ids
        return self.encoder(x) @ self.protos(ids).t()


class _MemoryBank(nn.Module):
    """Each example (``[B, T, 3]``) attends over a memory bank ``[K, F]`` (a parameter, or the
    forward's second argument): keys and values projected from it by hooked Linears."""

    def __init__(self, k: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                          nn.Linear(4, 2))  # fmt: skip
        self.memory = nn.Parameter(torch.randn(k, 4))

    def forward(self, x, memory=None):
        memory = self.memory if memory is None else memory
        att = torch.einsum("btf,kf->btk", self.q(x), self.k(memory)).softmax(-1)
        return self.o(att @ self.v(memory))


class _SharedAttention(nn.Module):
    """``nn.MultiheadAttention`` from each example's tokens to a memory ``[K, F]`` (a parameter,
    or the forward's second argument) expanded over the batch."""

    def __init__(self, k: int):
        super().__init__()
        self.inp, self.o = nn.Linear(3, 4), nn.Linear(4, 2)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.memory = nn.Parameter(torch.randn(k, 4))

    def forward(self, x, memory=None):
        memory = self.memory if memory is None else memory
        q = self.inp(x)
        kv = memory.unsqueeze(0).expand(q.shape[0], -1, -1)
        return self.o(self.att(q, kv, kv)[0])


SHARED = {
    "prototypes-cdist": (_Prototypes, None, lambda m: m.memory),
    "prototypes-two-layers": (_DeepPrototypes, None, lambda m: m.memory),
    "prototypes-relu-in-place": (_RectifiedPrototypes, None, lambda m: m.memory),
    "prototype-table": (_PrototypeTable, None, lambda m: torch.arange(m.k)),
    "memory-bank": (_MemoryBank, 2, lambda m: m.memory.detach().clone()),
    "shared-attention": (_SharedAttention, 2, lambda m: m.memory.detach().clone()),
}


def _check_shared(case: str, k: int, sizes: list[int], where: str, verify: bool = True):
    """Steps of batch sizes ``sizes`` under one handle (cleared between steps), the shared
    input stored on the module or passed to the forward: grad1 against the loop each step."""
    make, time, shared = SHARED[case]
    torch.manual_seed(0)
    m = make(k).double()
    extra = (shared(m),) if where == "argument" else ()
    if where == "argument" and isinstance(getattr(m, "memory", None), nn.Parameter):
        m.memory.requires_grad_(False)  # (the argument in its place)
    with gradhooks.add_hooks(m, loss_reduction="sum", verify=verify) as h:
        for batch in sizes:
            shape = (batch, 3) if time is None else (batch, time, 3)
            x = torch.randn(*shape, dtype=D)
            with gradhooks.paused():
                want = loop_rows(m, x, *extra)
            h.clear()
            sq(m(x, *extra)).backward()
            for n, p in m.named_parameters():
                if p.requires_grad:
                    assert_close(p.grad1, want[n], f"{case} ({where}) K={k} B={batch}: {n}")


@pytest.mark.parametrize("where", ["module", "argument"])
@pytest.mark.parametrize("batch", [4, 5, 1], ids=["B=K", "B>K", "B=1"])
@pytest.mark.parametrize("case", list(SHARED))
def test_a_shared_input_whatever_the_batch_size(case, batch, where):
    """A memory or prototype table ``[K, ...]`` shared by every example, K = 4: the same right
    answer whether the batch is as long (where a forward argument is taken as batched by its
    size, until what is computed from it alone would mix the examples), longer or 1."""
    _check_shared(case, 4, [batch], where)


@pytest.mark.parametrize("where", ["module", "argument"])
@pytest.mark.parametrize("case", list(SHARED))
def test_norms_of_a_shared_input_as_long_as_the_batch(case, where):
    """B = K = 4, norms only (no grad1 formed): each parameter's per-example norm as the
    loop's."""
    make, time, shared = SHARED[case]
    torch.manual_seed(0)
    m = make(4).double()
    extra = (shared(m),) if where == "argument" else ()
    if where == "argument" and isinstance(getattr(m, "memory", None), nn.Parameter):
        m.memory.requires_grad_(False)
    x = torch.randn(4, 3, dtype=D) if time is None else torch.randn(4, time, 3, dtype=D)
    want = loop_rows(m, x, *extra)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=("norms",)) as h:
        sq(m(x, *extra)).backward()
        got = h.param_norms()
    for n, w in want.items():
        assert_close(got[n], w.flatten(1).norm(dim=1), f"{case} ({where}): {n}")


@pytest.mark.parametrize("where", ["module", "argument"])
@pytest.mark.parametrize("case", list(SHARED))
def test_a_shared_input_without_verification(case, where):
    """B = K with ``verify=False``: right by itself, not only caught by the check."""
    _check_shared(case, 3, [3], where, verify=False)


@pytest.mark.parametrize("where", ["module", "argument"])
@pytest.mark.parametrize("case", list(SHARED))
def test_poisson_batch_sizes_over_steps(case, where):
    """Poisson-like batch sizes around K = 4 under one handle, an empty batch among them:
    every step right (was: refused at each step where B == K, or the empty one)."""
    _check_shared(case, 4, [4, 6, 4, 3, 0, 1, 4], where)


class _Gain(nn.Module):
    """A layer without a rule: a gain per feature (the ``torch.func`` fallback computes it)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return x * self.gain


class _GainedPrototypes(_Prototypes):
    """The prototypes through a layer without a rule before their encoder."""

    def __init__(self, k: int):
        super().__init__(k)
        self.gain = _Gain()

    def forward(self, x, memory=None):
        memory = self.memory if memory is None else memory
        return -torch.cdist(self.encoder(x), self.proto_encoder(torch.relu(self.gain(memory))))


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.MixedExamplesError,
    reason=(
        "A memory given to the forward as long as the batch, through a layer without a rule "
        "before its encoder: the fallback, which recomputes that layer one example at a time "
        "as the batch splits it, takes the memory as batched for good (a call of it is never "
        "made batch-free), so the comparison with every example is then refused as mixing "
        "them; a memory of another size, or stored on the module, is right."
    ),
)
def test_a_shared_input_through_a_layer_without_a_rule():
    """A false refusal: the loop, with the memory shared, agrees with autograd."""
    torch.manual_seed(0)
    m = _GainedPrototypes(3).double()
    memory, x = torch.randn(3, 4, dtype=D), torch.randn(3, 3, dtype=D)
    want = loop_rows(m, x, memory)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, memory)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], n)


class _TwoTowers(nn.Module):
    """Two inputs that both hold the examples (``[B, F]`` each), added row by row."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(5, 2)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def test_a_second_input_with_the_examples_stays_batched():
    """A second input as long as the batch that is combined with the examples row by row holds
    the examples: each example's own row of it."""
    torch.manual_seed(0)
    m = _TwoTowers().double()
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 5, dtype=D)
    named = dict(m.named_parameters())
    rows = [torch.autograd.grad(sq(m(x[i : i + 1], y[i : i + 1])), list(named.values()))
            for i in range(4)]  # fmt: skip
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, y)).backward()
    for k, (n, p) in enumerate(named.items()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)

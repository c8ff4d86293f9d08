"""nn.Embedding and nn.EmbeddingBag (2-D input, 1-D input with offsets, per_sample_weights,
padding_idx, sum/mean/max), against both oracles; and is_supported for every layer with a
built-in rule."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import Case, assert_close, check, run_hooked, sum_of_squares

REDUCTIONS = pytest.mark.parametrize("reduction", ["mean", "sum"])
BATCHES = st.sampled_from([0, 1, 3])


@REDUCTIONS
@settings(max_examples=15)
@given(
    num=st.integers(2, 5),
    shape=st.lists(st.integers(1, 4), max_size=2),
    padding=st.one_of(st.none(), st.integers(-2, 1)),
    batch=BATCHES,
)
def test_embedding(reduction, num, shape, padding, batch):
    def model():
        # a linear layer after it, so that the gradient reaching the lookup is not the output
        return nn.Sequential(nn.Embedding(num, 3, padding_idx=padding), nn.Linear(3, 2))

    case = Case(
        f"Embedding({num}, 3, padding_idx={padding}) on {shape}",
        model,
        lambda b: torch.randint(0, num, (b, *shape)),
    )
    check(case, batch=batch, reduction=reduction)


@REDUCTIONS
@pytest.mark.parametrize("padding", [None, 1])
def test_embedding_scale_grad_by_freq_counts_within_each_example(reduction, padding):
    """torch counts a row's occurrences in the batch it is given; an example's own loss sees
    only that example's occurrences, and that is what grad1 holds (so grad1 does not sum to
    .grad here: the batch gradient is scaled by batch-wide counts)."""
    torch.manual_seed(0)
    model = nn.Embedding(4, 3, padding_idx=padding, scale_grad_by_freq=True).double()
    x = torch.randint(0, 4, (5, 6))
    want = vmap_grad(model, sum_of_squares, x)["weight"]
    assert_close(loop_grad(model, sum_of_squares, x)["weight"], want, "loop vs vmap")
    plain = copy.deepcopy(model)
    batch_loss = sum_of_squares(plain(x))
    (batch_loss / x.shape[0] if reduction == "mean" else batch_loss).backward()
    run_hooked(model, Case("freq", None, None), x, None, reduction)
    assert_close(model.weight.grad1, want, f"scale_grad_by_freq ({reduction})")
    assert_close(model.weight.grad, plain.weight.grad, ".grad: autograd's, batch-wide counts")


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_table_cropped_in_place(bag):
    """A table replaced by a slice of itself (nanoGPT's ``crop_block_size``) while the module
    still says the old ``num_embeddings``: grad1 has the table's rows, as ``.grad`` does."""
    torch.manual_seed(0)
    table = nn.EmbeddingBag(8, 3) if bag else nn.Embedding(8, 3)
    table.weight = nn.Parameter(table.weight[:5].detach().clone())
    model = nn.Sequential(table, nn.Linear(3, 2)).double()
    x = torch.randint(0, 5, (4, 3))
    want = loop_grad(model, sum_of_squares, x)
    run_hooked(model, Case("cropped", None, None), x, None, "sum")
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"cropped, {name}")


def test_embedding_max_norm():
    """The forward renormalizes looked-up rows in place (vmap refuses that): the loop oracle."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, max_norm=0.5), nn.Linear(3, 2)).double()
    x = torch.randint(0, 5, (4, 3))
    model(x)  # renormalize every row the batch touches, so the loop sees the same weights
    want = loop_grad(model, sum_of_squares, x)
    run_hooked(model, Case("max_norm", None, None), x, None, "sum")
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"max_norm, {name}")


def test_embedding_sparse_gives_dense_grad1():
    torch.manual_seed(0)
    sparse = nn.Embedding(6, 3, sparse=True, padding_idx=0).double()
    dense = nn.Embedding(6, 3, padding_idx=0).double()
    dense.load_state_dict(sparse.state_dict())
    x = torch.randint(0, 6, (4, 5))
    want = loop_grad(dense, sum_of_squares, x)["weight"]
    for m in (sparse, dense):
        run_hooked(m, Case("sparse", None, None), x, None, "mean")
        assert_close(m.weight.grad1, want, f"sparse={m.sparse}")
    assert sparse.weight.grad.is_sparse, "sparse=True: .grad stays sparse, as autograd makes it"
    assert_close(sparse.weight.grad.to_dense(), want.mean(0), "sparse .grad")


@st.composite
def bag_setup(draw):
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    weighted = mode == "sum" and draw(st.booleans())
    padding = draw(st.one_of(st.none(), st.integers(0, 3)))
    return mode, weighted, padding, draw(st.integers(1, 4))


class Bags(nn.Module):
    """An EmbeddingBag then a Linear, taking ``[batch, length]`` indices (and per-sample
    weights): the bag gets them as they are (``flat=None``), or as a 1-D input with offsets,
    one bag per row (``flat`` = ``include_last_offset``)."""

    def __init__(self, bag, flat):
        super().__init__()
        self.bag, self.flat, self.out = bag, flat, nn.Linear(bag.embedding_dim, 2)

    def forward(self, idx, *weights):
        if self.flat is None:
            return self.out(self.bag(idx, None, *weights))
        n, length = idx.shape
        offsets = torch.arange(0, n * length + (length if self.flat else 0), length)
        return self.out(self.bag(idx.reshape(-1), offsets, *(w.reshape(-1) for w in weights)))


@REDUCTIONS
@settings(max_examples=15)
@given(setup=bag_setup(), flat=st.sampled_from([None, False, True]), batch=BATCHES)
def test_embedding_bag(reduction, setup, flat, batch):
    """2-D input (flat=None), or 1-D input with offsets, with or without the last offset."""
    mode, weighted, padding, length = setup

    def model():
        bag = nn.EmbeddingBag(4, 3, mode=mode, padding_idx=padding, include_last_offset=bool(flat))
        return Bags(bag, flat)

    def inputs(b):
        idx = torch.randint(0, 4, (b, length))
        return (idx, torch.randn(b, length)) if weighted else idx

    case = Case(
        f"EmbeddingBag({mode}, weighted={weighted}, padding_idx={padding}, flat={flat})",
        model,
        inputs,
    )
    check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_ragged_and_empty_bags(mode, include_last_offset):
    """Bags of different lengths, some empty, one all padding: each bag's gradient equals that
    of the bag passed alone."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(
        5, 3, mode=mode, padding_idx=4, include_last_offset=include_last_offset
    ).double()
    idx = torch.tensor([0, 1, 0, 2, 3, 1, 4, 4, 2])
    starts = [0, 2, 2, 5, 6, 8]  # bags: [0 1], [], [0 2 3], [1], [4 4] (all padding), [2]
    ends = starts[1:] + [len(idx)]
    offsets = torch.tensor(starts + ([len(idx)] if include_last_offset else []))
    psw = torch.randn(len(idx), dtype=torch.float64) if mode == "sum" else None
    want = []
    for s, e in zip(starts, ends, strict=True):
        args = (idx[s:e], torch.tensor([0] + ([e - s] if include_last_offset else [])))
        out = bag(*args, None if psw is None else psw[s:e])
        want.append(torch.autograd.grad(sum_of_squares(out), bag.weight, allow_unused=True)[0])
    with gradhooks.add_hooks(bag, loss_reduction="sum"):
        sum_of_squares(bag(idx, offsets, psw)).backward()
    assert_close(bag.weight.grad1, torch.stack(want), f"ragged bags ({mode})")
    assert_close(bag.weight.grad1.sum(0), bag.weight.grad, "grad1 sums to .grad")


class FlatBags(nn.Module):
    """An EmbeddingBag given the model's own first input, every example's tokens in one flat
    tensor cut into bags by ``offsets`` (the PyTorch text classification tutorial), then a
    Linear; ``mix``: the bags centred over the batch after the bag."""

    def __init__(self, mode: str, include_last_offset: bool, mix: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode=mode, include_last_offset=include_last_offset)
        self.out, self.mix = nn.Linear(3, 2), mix

    def forward(self, text, offsets):
        h = self.bag(text, offsets)
        return self.out(h - h.mean(0) if self.mix else h)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_on_the_models_flat_input_under_auto(mode, include_last_offset):
    """Under ``batch_dim="auto"`` the model's 1-D first input would make each token an
    example; the bag reading it makes each bag one, and the layers after it are followed
    with the bags as the batch: grad1 and the norms of every layer are each bag's own."""
    torch.manual_seed(0)
    model = FlatBags(mode, include_last_offset).double()
    lengths = [3, 1, 2, 4]
    text = torch.randint(0, 6, (sum(lengths),))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    offsets = torch.cat([starts, torch.tensor([len(text)])]) if include_last_offset else starts
    want = []
    for s, n in zip(starts.tolist(), lengths, strict=True):
        one = torch.tensor([0, n] if include_last_offset else [0])
        out = model(text[s : s + n], one)
        want.append(torch.autograd.grad(sum_of_squares(out), list(model.parameters())))
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        sum_of_squares(model(text, offsets)).backward()
        norms = h.norms()
    for k, (n, p) in enumerate(model.named_parameters()):
        assert_close(p.grad1, torch.stack([w[k] for w in want]), f"{mode}: {n}")
    whole = torch.stack([torch.cat([g.flatten() for g in w]).norm() for w in want])
    assert_close(norms, whole, f"{mode}: norms")


def test_embedding_bag_on_the_models_flat_input_then_mixed_is_refused():
    """The bags are the batch from the bag on: centring them over the batch after it mixes
    the examples, and the Linear that reads the result is refused."""
    torch.manual_seed(0)
    model = FlatBags("mean", False, mix=True).double()
    text, offsets = torch.randint(0, 6, (7,)), torch.tensor([0, 3, 4])
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match="'out'"):
            sum_of_squares(model(text, offsets)).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_embedding_bag_scale_grad_by_freq_is_a_clear_error():
    bag = nn.EmbeddingBag(4, 3, scale_grad_by_freq=True)
    with gradhooks.add_hooks(bag), pytest.raises(gradhooks.UnsupportedError):
        bag(torch.randint(0, 4, (2, 3))).sum().backward()


@pytest.mark.parametrize(
    "module, inputs",
    [
        (nn.Embedding(5, 3, padding_idx=0), (torch.randint(0, 5, (4, 3)),)),
        (nn.EmbeddingBag(5, 3, mode="mean"), (torch.randint(0, 5, (4, 3)),)),
        (nn.EmbeddingBag(5, 3, mode="max"), (torch.randint(0, 5, (4, 3)),)),
        (nn.EmbeddingBag(5, 3, mode="sum"), (torch.randint(0, 5, (4, 3)), None, torch.randn(4, 3))),
    ],
    ids=["Embedding", "EmbeddingBag-mean", "EmbeddingBag-max", "EmbeddingBag-weighted"],
)
def test_check_rule(module, inputs):
    inputs = tuple(t for t in inputs if t is not None)
    if len(inputs) == 2:  # per_sample_weights goes third: pass it by a wrapper
        module = Bags(module, None)
    assert gradhooks.check_rule(module, inputs).ok


NEW = [
    nn.Conv1d(2, 2, 1),
    nn.Conv3d(2, 2, 1),
    nn.ConvTranspose1d(2, 2, 1),
    nn.ConvTranspose2d(2, 2, 1),
    nn.ConvTranspose3d(2, 2, 1),
    nn.Embedding(3, 2),
    nn.EmbeddingBag(3, 2),
    nn.LayerNorm(2),
    nn.GroupNorm(1, 2),
    nn.RMSNorm(2),
    nn.InstanceNorm1d(2, affine=True),
    nn.InstanceNorm2d(2, affine=True),
    nn.InstanceNorm3d(2, affine=True),
    nn.BatchNorm1d(2),
    nn.BatchNorm2d(2),
    nn.BatchNorm3d(2),
    nn.PReLU(),
]


@pytest.mark.parametrize("module", NEW, ids=lambda m: type(m).__name__)
def test_is_supported(module):
    assert gradhooks.is_supported(module)


# -- the DP step: the table's batch gradient, which the book-keeping step does not use ------------


class _Lookup(nn.Module):
    """An embedding (``padding_idx`` 0) read at every position, and a Linear on the mean."""

    def __init__(self, num: int, dim: int, classes: int) -> None:
        super().__init__()
        self.table = nn.Embedding(num, dim, padding_idx=0)
        self.out = nn.Linear(dim, classes)

    def forward(self, x):
        return self.out(self.table(x).tanh().mean(1))


def _lookup_problem():
    torch.manual_seed(0)
    model = _Lookup(40, 6, 3).double()
    x, y = torch.randint(0, 40, (7, 5)), torch.randint(3, (7,))
    x[0, :2] = 0  # (padding rows)
    x[1] = x[2]  # (two examples on the same rows)
    return model, x, y


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_step_with_a_lookup_equals_the_per_example_loop(method):
    """The clipped sum plus noise of a model with an embedding, against a float64 per-example
    loop with the same clipping and the noise drawn by hand (two steps: the first is checked
    against autograd, the second not)."""
    import torch.nn.functional as F

    model, x, y = _lookup_problem()
    max_norm, sigma = 0.05, 0.4
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    assert (norms > max_norm).all(), "every example clipped"
    factors = max_norm / norms
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(2):
            gradhooks.dp_sgd_step(
                h, F.cross_entropy(model(x), y, reduction="none"), max_norm=max_norm,
                noise_multiplier=sigma, method=method,
                generator=torch.Generator().manual_seed(step),
            )  # fmt: skip
            gen = torch.Generator().manual_seed(step)
            for (name, g), p in zip(loop.items(), model.parameters(), strict=True):
                z = sigma * max_norm * torch.randn(p.shape, generator=gen, dtype=p.dtype)
                want = (torch.einsum("b,b...->...", factors, g) + z) / x.shape[0]
                assert_close(p.grad, want, f"{method}, step {step}: {name}")


def test_the_book_keeping_step_never_forms_the_tables_dense_gradient():
    """Autograd's gradient of a lookup is the whole table (``embedding_dense_backward``), which
    the book-keeping DP step does not use: the lookup runs with its table detached, so that
    autograd has no node for it. The only table-sized sum is the step's own, the rows looked up
    added into the noise (one ``index_add_``)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from gradhooks.engine.api import engine_of

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == model.table.weight.shape:
                self.seen.append(func.__name__)
            return out

    model, x, y = _lookup_problem()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(3):
            losses = F.cross_entropy(model(x), y, reduction="none")
            nodes, todo = set(), [losses.grad_fn]
            while todo:
                node = todo.pop()
                if node is not None and node not in nodes:
                    nodes.add(node)
                    todo.extend(f for f, _ in node.next_functions)
            assert not any("Embedding" in type(n).__name__ for n in nodes), nodes
            checked = engine_of(h).unverified
            with Ops() as ops:
                gradhooks.dp_sgd_step(h, losses, max_norm=0.05, noise_multiplier=0.4)
            if checked:  # (the step checked against autograd computes autograd's, once)
                continue
            assert "embedding_dense_backward.default" not in ops.seen, ops.seen
            assert ops.seen.count("index_add_.default") == 1, ops.seen
        assert not checked, "a step that was not checked"

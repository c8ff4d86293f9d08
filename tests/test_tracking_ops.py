"""The tracker's handlers against an empirical ownership oracle, over torch's OpInfo database.

For an operation the tracker follows, a sample input is given the batch on dimension ``d``
(its size there is the batch), the operation runs under a :class:`Tracker`, and an example's
entries of the input are changed (the first two examples' and the last's, in turn): the entries of the output that change must all be
ones the tracker's layout gives that example. An output the tracker calls batch-free must not
change at all. (An output it calls mixed or unknown claims nothing: it is refused, or checked
later.) Each operation is run with the batch on dimension 0 and on dimension 1, given in its
input alone and in every floating-point argument of the input's shape along ``d``, as a
function and in place; the first sample that has a dimension ``d`` of two or more is used.

``torch.testing._internal.common_methods_invocations.op_db`` is a private testing module of
torch's (it needs ``expecttest``): this file is skipped where it cannot be imported.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gradhooks.tracking import MIXED, UNKNOWN, Layout, Tracker, example_mask, memo

try:
    from torch.testing._internal.common_methods_invocations import op_db as _OP_DB
except Exception as e:  # (torch's own testing helpers, or expecttest, missing)
    _OP_DB, _WHY = [], f"torch's OpInfo database cannot be imported here: {e}"
else:
    _WHY = ""

# operations whose outputs change for reasons other than the examples' values
NOT_COMPARABLE = {
    "nn.functional.rrelu": "its random slopes are drawn for negative entries only, so "
    "changing one example shifts every later draw",
    "empty_like": "its values are whatever the memory held",
}
D = torch.float64


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _unchanged(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point() or a.is_complex():
        return (a == b) | (a.isnan() & b.isnan())
    return a == b


def _changed_example(ts: list[torch.Tensor], d: int, b: int, g: torch.Generator) -> None:
    """Change example ``b``'s entries (index ``b`` along ``d``) of every tensor of ``ts``."""
    for t in ts:
        at = (slice(None),) * d + (b,)
        if t.dtype == torch.bool:
            t[at] = ~t[at]
        elif t.is_floating_point() or t.is_complex():
            t[at] += (torch.randn(t[at].shape, generator=g, dtype=D) * 2 + 1).to(t.dtype)
        else:
            t[at] += 1


def _tracked(fn, batched: list[torch.Tensor], d: int) -> tuple[list, list] | None:
    """``fn(*batched)`` run under a tracker, each tensor of ``batched`` (cloned) with the batch
    on dimension ``d``: its outputs and the layouts the tracker gives them (``None``: it
    raised)."""
    tracker = Tracker(batched[0].shape[d], {})
    inputs = [t.clone() for t in batched]
    for t in inputs:
        tracker.set_layout(t, Layout(d))
    try:
        with tracker:
            torch.manual_seed(0)
            outs = _outputs(fn(*inputs))
    except Exception:
        return None
    return outs, [tracker.layout(o) for o in outs]


def ownership(fn, batched: list[torch.Tensor], d: int) -> tuple[str, list[str]]:
    """Run ``fn(*batched)`` under a tracker, each tensor of ``batched`` with the batch on
    dimension ``d``, and check its outputs' layouts against what changing an example does (the
    first two and the last).
    Returns what the tracker claimed (``"followed"``, ``"mixed"``, ``"unknown"``, or
    ``"failed"`` where the operation raised) and the problems found."""
    batch = batched[0].shape[d]
    found = _tracked(fn, batched, d)
    if found is None:
        return "failed", []
    outs, lays = found
    claimed = [j for j, lay in enumerate(lays) if lay is None or lay.dim >= 0]
    if not claimed:
        return ("mixed" if MIXED in lays else "unknown"), []
    g = torch.Generator().manual_seed(0)
    problems = []
    for b in sorted({0, 1, batch - 1}):  # (the first two examples, and the last)
        changed = [t.clone() for t in batched]
        _changed_example(changed, d, b, g)
        torch.manual_seed(0)
        try:
            again = _outputs(fn(*changed))
        except Exception:  # (the changed values out of the operation's domain)
            continue
        for j in claimed:
            if again[j].shape != outs[j].shape:
                continue  # (a shape read from the values: one_hot's number of classes)
            moved = ~_unchanged(outs[j], again[j])
            if lays[j] is None:
                if moved.any():
                    problems.append(f"output {j} called batch-free changes with example {b}")
                continue
            others = moved & ~example_mask(outs[j].shape, lays[j], batch, outs[j].device)[b]
            if others.any():
                problems.append(
                    f"output {j} {tuple(outs[j].shape)} as {lays[j]}: changing example {b} "
                    f"changes {int(others.sum())} entries of other examples"
                )
    return "followed", problems


def _sample(info, d: int):
    dtypes = info.supported_dtypes("cpu")
    if not dtypes:
        return None  # (a CUDA kernel alone)
    dtype = D if D in dtypes else next(iter(dtypes))
    torch.manual_seed(0)
    # (the OpInfo's own generator: sample_inputs() wraps it in a tracker of test functions
    # that reads the whole Python stack for every sample)
    for k, s in enumerate(info.sample_inputs_func(info, "cpu", dtype, False)):
        if isinstance(s.input, torch.Tensor) and s.input.dim() > d and s.input.shape[d] >= 2:
            return s
        if k >= 20:
            return None
    return None


def _alone(op, args: list, kwargs: dict, x: torch.Tensor):
    return op(x, *args, **kwargs)


def _every(op, args: list, kwargs: dict, alongside: list[int], x: torch.Tensor, *more):
    given = list(args)
    for i, m in zip(alongside, more):
        given[i] = m
    return op(x, *given, **kwargs)


def _runs(key: str, other=None):
    """The runs of OpInfo ``key``'s operation: ``(d, fn, batched)``, with the batch on
    dimension 0 and 1, in the input alone and in every argument of its shape, as a function
    and in place. ``other``: given, the tensors among the sample's arguments are
    ``other(t)`` instead (other values)."""
    info = _BY_KEY[key]
    for d in (0, 1):
        sample = _sample(info, d)
        if sample is None:
            continue
        x, args, kwargs = sample.input, list(sample.args), dict(sample.kwargs)
        alongside = [
            i for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            and a.dim() == x.dim() and a.shape[d] == x.shape[d]
        ]  # fmt: skip
        if other is not None:
            x = other(x)
            args = [other(a) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: other(a) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
        for op in (info.op, info.inplace_variant):
            if op is None:
                continue
            yield d, functools.partial(_alone, op, args, kwargs), [x]
            if alongside:
                every = functools.partial(_every, op, args, kwargs, alongside)
                yield d, every, [x, *(args[i] for i in alongside)]


@functools.cache
def sweep(key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every run of the operation of OpInfo ``key`` (cached): what the tracker claimed, and
    the problems found."""
    claims, problems = [], []
    for d, fn, batched in _runs(key):
        claim, found = ownership(fn, batched, d)
        claims.append(claim)
        problems += [f"d={d}: {p}" for p in found]
    return tuple(claims), tuple(problems)


def _layouts(fn, batched: list[torch.Tensor], d: int) -> list | None:
    """The layouts a tracker gives the outputs of ``fn(*batched)`` (:func:`_tracked`)."""
    found = _tracked(fn, batched, d)
    return None if found is None else found[1]


def _other_values(g: torch.Generator):
    """A tensor of the same shape, dtype and layout with other values: floats drawn afresh,
    flags flipped at random, integers drawn between the tensor's own least and greatest
    (an index stays in range)."""

    def other(t: torch.Tensor) -> torch.Tensor:
        if t.is_sparse or t.numel() == 0 or t.layout != torch.strided:
            return t
        if t.dtype == torch.bool:
            return torch.rand(t.shape, generator=g) < 0.5
        if t.is_floating_point() or t.is_complex():
            try:
                return (torch.randn(t.shape, generator=g, dtype=D) * 2 + 1).to(t.dtype)
            except (RuntimeError, TypeError):  # (float8: no conversion this way)
                return t
        lo, hi = int(t.min()), int(t.max())
        return torch.randint(lo, hi + 1, t.shape, generator=g).to(t.dtype)

    return other


def kept_problems(key: str) -> list[str]:
    """Every run of OpInfo ``key``'s operation, once, then with other values in every tensor
    argument, where the tracker takes what it kept of the first
    (:mod:`gradhooks.tracking.memo`), against the second followed afresh: a handler that
    reads values, not kept as one, differs."""
    problems = []
    firsts = list(_runs(key))
    seconds = list(_runs(key, _other_values(torch.Generator().manual_seed(1))))
    for (d, fn, batched), (_, fn2, batched2) in zip(firsts, seconds):
        memo.clear()
        if _layouts(fn, batched, d) is None:
            continue
        kept = _layouts(fn2, batched2, d)
        memo.clear()
        fresh = _layouts(fn2, batched2, d)
        if kept != fresh:
            problems.append(f"d={d}: kept {kept}, followed afresh {fresh}")
    memo.clear()
    return problems


_BY_KEY = {f"{i.name}.{i.variant_test_name}".rstrip("."): i for i in _OP_DB}


@pytest.mark.skipif(not _OP_DB, reason=_WHY or "no OpInfo database")
@pytest.mark.parametrize("key", sorted(_BY_KEY) or ["none"])
def test_op(key):
    if key.split(".")[0] in NOT_COMPARABLE or key in NOT_COMPARABLE:
        pytest.skip(NOT_COMPARABLE.get(key, ""))
    _, problems = sweep(key)
    assert not problems, f"{key}: " + "; ".join(problems[:4])


@pytest.mark.skipif(not _OP_DB, reason=_WHY or "no OpInfo database")
@pytest.mark.parametrize("key", sorted(_BY_KEY) or ["none"])
def test_what_is_kept_is_what_the_tracker_finds(key):
    """A call like one followed before (the same arguments, layouts, shapes and dtypes, other
    values) is given the layouts kept from it: the same as following it afresh."""
    if key.split(".")[0] in NOT_COMPARABLE or key in NOT_COMPARABLE:
        pytest.skip(NOT_COMPARABLE.get(key, ""))
    problems = kept_problems(key)
    assert not problems, f"{key}: " + "; ".join(problems[:4])


@pytest.mark.skipif(not _OP_DB, reason=_WHY or "no OpInfo database")
def test_the_sweep_covers_most_operations():
    """The sweep checks a layout the tracker claims for most of the database's operations
    (374 of 702 OpInfos with torch 2.13; the others have no usable sample, or the tracker
    does not follow them)."""
    keys = [k for k in _BY_KEY if k not in NOT_COMPARABLE]
    followed = [k for k in keys if "followed" in sweep(k)[0]]
    assert len(followed) >= 0.45 * len(_BY_KEY), (len(followed), len(_BY_KEY))


# -- handlers the sweep found wrong --------------------------------------------------------------


def _layout_of(fn, batched: list[torch.Tensor], d: int):
    tracker = Tracker(batched[0].shape[d], {})
    for t in batched:
        tracker.set_layout(t, Layout(d))
    with tracker:
        out = fn(*batched)
    return tracker.layout(_outputs(out)[0])


def test_an_unbatched_convolution_input_holds_channels_on_dimension_0():
    """``F.conv1d`` of ``[C, L]`` (unbatched): dimension 0 holds channels, which the
    convolution mixes; not the examples' layout."""
    w = torch.randn(3, 3, 2, dtype=D)
    x = torch.randn(3, 6, dtype=D)
    claim, problems = ownership(lambda x: F.conv1d(x, w), [x], 0)
    assert not problems and claim != "followed"
    assert _layout_of(lambda x: F.conv1d(x, w), [x], 0) is UNKNOWN
    x = torch.randn(3, 3, 6, dtype=D)  # (batched: followed)
    assert ownership(lambda x: F.conv1d(x, w), [x], 0) == ("followed", [])


def test_a_convolution_weight_with_examples_is_not_the_inputs_layout():
    """A weight whose dimension 0 holds the examples (as long as the batch): the output's
    dimension 1 comes from it, not dimension 0."""
    x = torch.randn(3, 2, 5, dtype=D)
    claim, problems = ownership(lambda w: F.conv1d(x, w), [torch.randn(3, 2, 2, dtype=D)], 0)
    assert not problems and claim == "unknown"


def test_squeeze_in_place_before_the_batch():
    """``x.squeeze_(0)`` of ``[1, B, B]`` with the batch on dimension 1: the batch is on
    dimension 0 afterwards; a layout before ``dim`` stays, and unsqueeze_ shifts it."""
    x = torch.randn(1, 3, 3, dtype=D)
    claim, problems = ownership(lambda x: x.squeeze_(0), [x], 1)
    assert not problems
    y = torch.randn(3, 3, 1, dtype=D)
    assert ownership(lambda y: y.squeeze_(2), [y], 1) == ("followed", [])
    assert _layout_of(lambda y: y.squeeze_(-1), [y], 0) == Layout(0)
    assert _layout_of(lambda y: y.unsqueeze_(0), [torch.randn(3, 4, dtype=D)], 0) == Layout(1)
    assert ownership(lambda y: y.unsqueeze_(0), [torch.randn(3, 4, dtype=D)], 0)[1] == []


def test_rows_indexed_by_a_range_keep_their_examples():
    """``q[range(B), actions]`` (Rainbow's and many DQN agents' pick of each row's action)
    indexes as ``q[list(range(B)), actions]`` does: each row keeps its example. A range is
    followed as its list is, also where it reverses the batch or cuts it."""
    q = torch.randn(3, 4, 2, dtype=D)
    actions = torch.tensor([2, 0, 3])
    for index in (lambda q: q[range(3), actions], lambda q: q[range(3)], lambda q: q[range(3), 1]):
        assert _layout_of(index, [q], 0) == Layout(0)
        assert ownership(index, [q], 0) == ("followed", [])
    for r in (range(2, -1, -1), range(2), range(0, 3, 2)):
        as_range = _layout_of(lambda q, r=r: q[r, actions[: len(r)]], [q], 0)
        assert as_range == _layout_of(lambda q, r=r: q[list(r), actions[: len(r)]], [q], 0), r


def test_batch_norm_of_chunks_of_the_batch_by_its_running_statistics():
    """A batch norm applied to chunks of the batch (TabNet's ghost batch norm, ``torch.cat`` of
    ``bn(chunk)`` over ``x.chunk(k)``): by its running statistics each row is normalized alone,
    and followed; by the chunk's own statistics (training, or no running statistics) each
    chunk's rows are mixed."""
    mean, var = torch.randn(4, dtype=D), torch.rand(4, dtype=D) + 0.5

    def ghost(training: bool, running: bool = True):
        def f(x):
            chunks = x.chunk(2, 0)
            stats = (mean, var) if running else (None, None)
            return torch.cat([F.batch_norm(c, *stats, training=training) for c in chunks], 0)

        return f

    x = torch.randn(4, 4, dtype=D)
    assert ownership(ghost(False), [x], 0) == ("followed", [])
    assert _layout_of(ghost(False), [x], 0) is not MIXED
    for f in (ghost(True), ghost(True, running=False)):
        claim, problems = ownership(f, [x], 0)
        assert not problems and claim == "mixed"


def test_resize_in_place_is_not_followed():
    x = torch.randn(2, 3, dtype=D)
    claim, problems = ownership(lambda x: x.resize_(3, 3), [x], 1)
    assert not problems and claim == "unknown"


def test_masked_scatter_of_a_source_with_examples():
    """``x.masked_scatter(mask, source)`` takes the source's entries in turn over the whole
    tensor: where the source holds examples, one example's entries land in another's rows."""
    torch.manual_seed(0)
    mask = torch.rand(3, 4) > 0.5
    x, source = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    claim, problems = ownership(lambda x, s: x.masked_scatter(mask, s), [x, source], 0)
    assert not problems and claim == "unknown"
    # (a batch-free source: each entry is x's or the source's, elementwise in x)
    assert ownership(lambda x: x.masked_scatter(mask, source), [x], 0) == ("followed", [])


def test_pixel_shuffle_keeps_a_layout_among_the_leading_dimensions():
    """``[*, C r², H, W]``: the leading dimensions stay (a sequence-first ``[T, B, ...]``);
    an unbatched ``[C r², H, W]`` holds channels on dimension 0."""
    x = torch.randn(2, 3, 4, 2, 2, dtype=D)
    assert ownership(lambda x: F.pixel_shuffle(x, 2), [x], 1) == ("followed", [])
    assert _layout_of(lambda x: F.pixel_shuffle(x, 2), [torch.randn(4, 2, 2, dtype=D)], 0) is (
        UNKNOWN
    )


def test_embedding_bag_of_a_flat_input_with_offsets():
    """Bags given by offsets over a flat input hold indices of any rows; a ``[bags, n]`` input
    holds one bag per row."""
    w = torch.randn(10, 4, dtype=D)
    flat = torch.tensor([1, 2, 3, 4, 5, 6])
    bags = _layout_of(lambda i: F.embedding_bag(i, w, torch.tensor([0, 1, 2, 3, 4, 5])), [flat], 0)
    assert bags is UNKNOWN
    rows = torch.tensor([[1, 2], [3, 4], [5, 6]])
    assert _layout_of(lambda i: F.embedding_bag(i, w), [rows], 0) == Layout(0)


_SPECIAL = {
    "erf": torch.special.erf,
    "erfc": torch.special.erfc,
    "erfinv": lambda x: torch.special.erfinv(x.tanh()),
    "expm1": torch.special.expm1,
    "exp2": torch.special.exp2,
    "log1p": lambda x: torch.special.log1p(x.abs()),
    "sinc": torch.special.sinc,
    "round": torch.special.round,
    "ndtr": torch.special.ndtr,
    "logit": lambda x: torch.special.logit(x.sigmoid()),
    "psi": lambda x: torch.special.psi(x.abs() + 1),
    "digamma": lambda x: torch.special.digamma(x.abs() + 1),
    "gammaln": torch.special.gammaln,
    "i0": torch.special.i0,
    "xlogy": lambda x: torch.special.xlogy(x, x.abs() + 1),
    "polygamma": lambda x: torch.special.polygamma(1, x.abs() + 1),
    "multigammaln": lambda x: torch.special.multigammaln(x.abs() + 2, 2),
    "gammainc": lambda x: torch.special.gammainc(x.abs() + 1, x.abs()),
    "gammaincc": lambda x: torch.special.gammaincc(x.abs() + 1, x.abs()),
    "softmax": lambda x: torch.special.softmax(x, -1),
    "log_softmax": lambda x: torch.special.log_softmax(x, -1),
    "logsumexp": lambda x: torch.special.logsumexp(x, -1),
}


@pytest.mark.parametrize("name", sorted(_SPECIAL))
def test_the_special_aliases_keep_the_batch(name):
    """``torch.special.erf`` and the other aliases in ``torch.special`` are followed as the
    functions they alias (Mega's attention weights are ``special.erf`` of the scores: the
    batch was lost there, and a position bias added to them later was refused)."""
    x = torch.randn(3, 4, 5, dtype=D)
    for d in (0, 1):
        assert ownership(_SPECIAL[name], [x], d) == ("followed", [])


# -- operations without a handler, in a module without a rule ---------------------------------


class _Unfollowed(torch.nn.Module):
    """A module without a rule whose weight scales its input (the tracker gives ``w`` its
    per-example gradients itself), then ``op``, a torch function the tracker has no handler
    for."""

    def __init__(self, op, features: int = 3):
        super().__init__()
        self.op = op
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(features, dtype=D))

    def forward(self, x):
        return self.op(x * self.w)


# each changes what dimension 0 holds: pairs, products or sums of rows of several examples
_ROWS_LOST = {
    "combinations": lambda h: torch.combinations(h[:, 0]),
    "cartesian_prod": lambda h: torch.cartesian_prod(h[:, 0], h[:, 1]),
    "kron": lambda h: torch.kron(h, h),
    "sum_to_size": lambda h: h.sum_to_size(1, h.shape[1]),
}


def _after_a_linear(op):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3).double(), _Unfollowed(op))


def _op_alone(op):
    torch.manual_seed(0)
    return _Unfollowed(op)


@pytest.mark.parametrize("place", [_op_alone, _after_a_linear], ids=["alone", "after_a_linear"])
@pytest.mark.parametrize("name", sorted(_ROWS_LOST))
def test_rows_an_unfollowed_operation_changes_are_refused(name, place):
    """The loss of ``op(x * w)`` is no sum of the examples' own losses: grad1 of ``w`` (and
    of the Linear before it) read from the batch's rows would be each example's share of the
    batch's gradient, silently. The backward that reaches the operation is refused, naming the
    module, the parameter, the operation and the shapes, and writes no grad1."""
    import gradhooks
    from gradhooks.errors import MixedExamplesError

    model = place(_ROWS_LOST[name])
    x = torch.randn(5, 3, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(MixedExamplesError) as caught:
            (model(x) ** 2).sum().backward()
        assert all(getattr(p, "grad1", None) is None for p in model.parameters())
    said = str(caught.value)
    assert name in said and "the 5 examples" in said and "w'" in said


def _sum_sq(out):
    return (out**2).sum()


def _assert_loop(model, x, **hooks):
    import gradhooks
    from gradhooks.oracle import loop_grad

    want = loop_grad(model, _sum_sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum", **hooks):
        _sum_sq(model(x)).backward()
        for n, p in model.named_parameters():
            assert p.grad1.shape == want[n].shape, n
            assert torch.allclose(p.grad1, want[n], rtol=1e-7, atol=1e-9), n


class _Beside(torch.nn.Module):
    """``op`` of the batch beside the output, which the loss does not use."""

    def __init__(self, op):
        super().__init__()
        self.inner = _after_a_linear(lambda h: h)
        self.op = op

    def forward(self, x):
        h = self.inner(x)
        self.seen = self.op(h)  # (kept, never backpropagated)
        return h


def test_rows_lost_where_no_backward_goes_are_not_refused():
    torch.manual_seed(0)
    _assert_loop(_Beside(_ROWS_LOST["kron"]), torch.randn(5, 3, dtype=D))


def test_an_unfollowed_operation_on_each_example_alone_is_followed():
    """The same operation, on each example's rows alone and joined back: right."""
    each = lambda h: torch.stack([torch.kron(r, r) for r in h])  # noqa: E731
    _assert_loop(_after_a_linear(each), torch.randn(5, 3, dtype=D))


def test_an_unfollowed_operation_that_keeps_each_examples_rows_is_followed():
    """``torch.linalg.cross`` along the features (no handler): each row is its example's,
    presumed where the input had them, and checked by the probe."""
    axis = torch.tensor([0.3, -1.0, 2.0], dtype=D)
    cross = lambda h: torch.linalg.cross(h, axis.expand_as(h), dim=-1)  # noqa: E731
    _assert_loop(_after_a_linear(cross), torch.randn(5, 3, dtype=D))


def test_an_unfollowed_operation_on_a_sequence_first_batch_is_followed():
    """With the examples on dimension 1 (``batch_dim=1``), the rows of dimension 0 are time
    steps: ``torch.linalg.cross`` keeps the examples there, and nothing is refused."""
    import gradhooks

    torch.manual_seed(0)
    axis = torch.tensor([0.3, -1.0, 2.0], dtype=D)
    model = _after_a_linear(lambda h: torch.linalg.cross(h, axis.expand_as(h), dim=-1))
    x = torch.randn(4, 5, 3, dtype=D)  # [time, batch, features]
    want = {n: [] for n, _ in model.named_parameters()}
    for b in range(x.shape[1]):
        grads = torch.autograd.grad(_sum_sq(model(x[:, b : b + 1])), list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            want[n].append(g)
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=1):
        _sum_sq(model(x)).backward()
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad1, torch.stack(want[n]), rtol=1e-7, atol=1e-9), n


@pytest.mark.parametrize(
    "count",
    [
        lambda h: torch.histc(h[:, 0], bins=h.shape[0]),
        lambda h: torch.bincount((h[:, 0].detach() > 1).long(), minlength=h.shape[0]).to(D),
        # (boundaries of each example's own, one each: every entry is placed among them all)
        lambda h: torch.bucketize(h[:, 0].detach(), h[:, 1].detach()).to(D),
        lambda h: torch.searchsorted(h[:, 1].detach().contiguous(), h[:, 0].detach()).to(D),
    ],
    ids=["histc", "bincount", "bucketize_by_the_batch", "searchsorted_in_the_batch"],
)
def test_counts_over_the_batch_without_a_gradient_are_mixed(count):
    """A histogram of the batch has no gradient, and, as long as the batch, looked like its
    rows: each example's output was scaled by the whole batch's counts, silently. The
    counts are across the examples: refused."""
    import gradhooks
    from gradhooks.errors import MixedExamplesError

    model = _after_a_linear(lambda h: count(h).unsqueeze(1) * h)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(MixedExamplesError):
            _sum_sq(model(torch.randn(5, 3, dtype=D))).backward()


def test_bucketize_by_fixed_boundaries_keeps_the_rows():
    bounds = torch.tensor([-0.5, 0.0, 0.5], dtype=D)
    model = _after_a_linear(lambda h: torch.bucketize(h.detach(), bounds).to(D) * h)
    _assert_loop(model, torch.randn(5, 3, dtype=D))

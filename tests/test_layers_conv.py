"""Convolutions (Conv1d/2d/3d, ConvTranspose1d/2d/3d) over a sweep of every hyper-parameter
(hypothesis), each against both oracles; the grouped and column forms of grad1; Jacobians."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks
from gradhooks.rules import conv as conv_rules
from harness import Case, check, cpu_only

GROUPED = cpu_only("a convolution's grouped form is taken on the CPU alone")

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# grad1 of a convolution weight by the grouped convolution (the whole batch in one call, or
# one example per call) or by the columns: each form on every case, whatever the number of
# columns would choose.
FORMS = {
    "grouped": {"conv_grouped_min_columns": 0, "conv_grouped_call_elements": 10**9},
    "grouped-slices": {"conv_grouped_min_columns": 0, "conv_grouped_call_elements": 1},
    "columns": {"conv_grouped_min_columns": 10**9, "conv_grouped_call_elements": 10**9},
}


def grad1_form(form):
    return gradhooks.tuned(**FORMS[form])


@st.composite
def conv_cases(draw, dims):
    groups = draw(st.sampled_from([1, 2, 3]))
    depthwise = draw(st.booleans())
    in_ch = groups * draw(st.integers(1, 2))
    out_ch = in_ch * draw(st.integers(1, 2)) if depthwise else groups * draw(st.integers(1, 2))
    if depthwise:
        groups = in_ch
    kernel = draw(st.tuples(*[st.integers(1, 3)] * dims))
    dilation = draw(st.tuples(*[st.integers(1, 2)] * dims))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding = draw(
        st.one_of(
            st.sampled_from(["same", "valid"]),
            st.integers(0, 2),
            st.tuples(*[st.integers(0, 2)] * dims),
        )
    )
    stride = (
        1
        if padding == "same"
        else draw(st.one_of(st.integers(1, 2), st.tuples(*[st.integers(1, 2)] * dims)))
    )
    bias = draw(st.booleans())
    size = draw(st.integers(4, 7)) if dims < 3 else draw(st.integers(4, 5))
    kwargs = dict(
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=bias,
        padding_mode=padding_mode,
    )
    spatial = (size,) * dims
    return Case(
        f"conv{dims}d{kwargs}",
        lambda: CONV[dims](in_ch, out_ch, **kwargs),
        lambda b: torch.randn(b, in_ch, *spatial),
    )


def _valid(case):
    try:
        m = case.model()
        m(case.inputs(1))
    except (RuntimeError, ValueError, NotImplementedError):
        return False  # e.g. reflect padding wider than the input: torch refuses it too
    return True


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@given(case=conv_cases(2), batch=st.sampled_from([1, 3]))
def test_conv2d_sweep(case, batch, reduction, form):
    if _valid(case):
        with grad1_form(form):
            check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(padding="same", dilation=2, kernel_size=4),
        dict(padding="valid", kernel_size=3, stride=2),
        dict(padding=(1, 2), kernel_size=(3, 2), padding_mode="reflect"),
        dict(padding=1, kernel_size=3, padding_mode="circular", groups=2),
        dict(padding=2, kernel_size=3, padding_mode="replicate", dilation=(2, 1)),
        dict(kernel_size=3, groups=4),  # depthwise
    ],
    ids=str,
)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_conv2d_named(kwargs, batch, form):
    case = Case(
        f"conv2d{kwargs}", lambda: nn.Conv2d(4, 8, **kwargs), lambda b: torch.randn(b, 4, 7, 6)
    )
    with grad1_form(form):
        check(case, batch=batch)


@pytest.mark.parametrize("channels, grouped", [(3, False), pytest.param(8, True, marks=GROUPED)])
def test_conv_grad1_form_by_columns(channels, grouped):
    """A 3x3 convolution over 3 channels (27 columns) takes grad1 by the columns, over 8 (72)
    by the grouped convolution."""
    conv = nn.Conv2d(channels, 4, 3, padding=1)
    x, g = torch.randn(2, channels, 6, 6), torch.randn(2, 4, 6, 6)
    assert conv_rules.ConvWeight(conv, x, g)._grouped_form() == grouped


class _ConvHead(nn.Module):
    """A convolution and a small linear head (few outputs: the Jacobian stays small)."""

    def __init__(self, conv: nn.Module, inputs) -> None:
        super().__init__()
        self.conv = conv
        self.head = nn.Linear(conv(inputs).flatten(1).shape[1], 2)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@settings(max_examples=15, deadline=None)
@given(dims=st.sampled_from([1, 2, 3]), data=st.data(), batch=st.sampled_from([1, 2]))
def test_conv_jacobians_sweep(dims, data, batch):
    """Per-example Jacobians of a convolution (the grouped-convolution form where it has more
    output positions than output channels times outputs, columns and a matmul elsewhere) equal
    a loop of one backward per example and output, and vmap(jacrev)."""
    from test_quantities import check_jacobians, loop_jacobians, vmap_jacrev

    case = data.draw(conv_cases(dims))
    if not _valid(case):
        return
    torch.manual_seed(0)
    x = case.inputs(batch).double()
    model = _ConvHead(case.model().double(), x).double()
    check_jacobians(model, x, loop_jacobians(model, x), case.id)
    check_jacobians(model, x, vmap_jacrev(model, x), case.id)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(
    "size, grouped", [pytest.param(7, True, marks=GROUPED), (5, False), (3, False)]
)
def test_conv_jacobians_choose_the_form(size, grouped, groups, monkeypatch):
    """Conv2d(2, 6, 3) with a 2-output head: 25 output positions (> 2 outputs x 6 channels) take
    the grouped-convolution form; 9 (more than the channels, not than their rows for all
    outputs) and 1 take the columns and one matmul per example; all equal vmap(jacrev)."""
    from test_quantities import check_jacobians, vmap_jacrev

    from gradhooks.rules.conv import ConvWeight

    used = []
    original = ConvWeight.grouped_jacobian_into
    monkeypatch.setattr(
        ConvWeight, "grouped_jacobian_into", lambda *a: used.append(original(*a)) or used[-1]
    )
    torch.manual_seed(0)
    x = torch.randn(3, 2, size, size, dtype=torch.float64)
    model = _ConvHead(nn.Conv2d(2, 6, 3, groups=groups).double(), x).double()
    check_jacobians(model, x, vmap_jacrev(model, x), f"size {size}")
    assert used and all(u == grouped for u in used)


@GROUPED
@pytest.mark.parametrize("groups", [1, 3])
def test_conv_jacobians_grouped_form_of_a_reused_conv(groups, monkeypatch):
    """A convolution called twice (its second call's Jacobian added to the first's) by the
    grouped-convolution form, one output at a time, against the per-example loop."""
    from test_quantities import check_jacobians, loop_jacobians

    from gradhooks.rules.conv import ConvWeight

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1, groups=groups)
            self.head = nn.Linear(3 * 12 * 12, 2)

        def forward(self, x):
            return self.head(self.conv(torch.tanh(self.conv(x))).flatten(1))

    used = []
    original = ConvWeight.grouped_jacobian_into
    monkeypatch.setattr(
        ConvWeight, "grouped_jacobian_into", lambda *a: used.append(original(*a)) or used[-1]
    )
    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64)
    check_jacobians(model, x, loop_jacobians(model, x), f"conv twice, groups={groups}")
    assert used and all(used)


class _ConvTwice(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=groups)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        return self.head(self.conv(torch.tanh(self.conv(x))).flatten(1))


@GROUPED
@pytest.mark.parametrize("form", ["grouped", "grouped-slices"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_bias_from_the_grouped_backward(form, reduction, groups, monkeypatch):
    """Where the weight's grouped convolution backward runs, the bias's per-example sums come
    from it (every call of a reused convolution: written, then added), equal to the oracles;
    for a frozen bias that backward does not form them."""
    taken, asked = [], []
    take, grouped = conv_rules.ConvBias._take, conv_rules.ConvWeight._grad1_grouped
    monkeypatch.setattr(
        conv_rules.ConvBias, "_take", lambda *a: taken.append(take(*a)) or taken[-1]
    )
    monkeypatch.setattr(
        conv_rules.ConvWeight,
        "_grad1_grouped",
        lambda self, scale, with_bias=False: (
            asked.append(with_bias) or grouped(self, scale, with_bias)
        ),
    )
    case = Case(
        f"conv twice, groups={groups}",
        lambda: _ConvTwice(groups),
        lambda b: torch.randn(b, 4, 6, 6),
    )
    with grad1_form(form):
        check(case, batch=3, reduction=reduction)
    assert len(taken) == 2 and all(t is not None for t in taken)
    assert asked and all(asked)

    frozen = Case(
        "frozen bias", lambda: _frozen_bias(_ConvTwice(groups)), lambda b: torch.randn(b, 4, 6, 6)
    )
    asked.clear()
    with grad1_form(form):
        check(frozen, batch=3, reduction=reduction)
    assert asked and not any(asked)


def _frozen_bias(model: _ConvTwice) -> _ConvTwice:
    model.conv.bias.requires_grad_(False)
    return model


@GROUPED
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_jacobians_bias_from_the_grouped_backward(groups, monkeypatch):
    """The Jacobians of a reused convolution's bias come from its weight's grouped convolution
    backward (both calls), equal to the per-example loop's."""
    from test_quantities import check_jacobians, loop_jacobians

    taken = []
    take = conv_rules.ConvBias._take
    monkeypatch.setattr(
        conv_rules.ConvBias, "_take", lambda *a: taken.append(take(*a)) or taken[-1]
    )
    torch.manual_seed(0)
    model = _ConvTwice(groups).double()
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    check_jacobians(model, x, loop_jacobians(model, x), f"conv twice, groups={groups}")
    # both calls, each time the Jacobians are taken
    assert taken and all(t is not None for t in taken)


@settings(max_examples=30, deadline=None)
@given(dims=st.sampled_from([1, 2, 3]), data=st.data(), batch=st.sampled_from([1, 2]))
def test_column_gram_from_the_positions_gram(dims, data, batch):
    """The per-example Gram of a convolution's columns taken from the Gram of its padded input's
    positions (``ConvWeight._gram_from_positions``, what norms use where that is cheaper) equals
    the columns' own, for every geometry, of one call and between two calls."""
    from gradhooks.rules.conv import ConvWeight

    case = data.draw(conv_cases(dims))
    if not _valid(case):
        return
    torch.manual_seed(0)
    m = case.model().double()
    x1, x2 = case.inputs(batch).double(), case.inputs(batch).double()
    with torch.no_grad():
        p = ConvWeight(m, x1, torch.randn_like(m(x1)))
        q = ConvWeight(m, x2, torch.randn_like(m(x2)))
    for other in (p, q):
        want = torch.einsum("b...si,b...ti->b...st", p.a, other.a)
        torch.testing.assert_close(p._gram_from_positions(other), want, msg=case.id)


def test_column_gram_takes_the_positions_form_where_cheaper():
    """3x3 over 4x4 with padding 1: 36 padded positions, 16 outputs (36² < 16² · 9): the
    positions form; 1x1 with stride 2 (64 positions, 16 outputs): the columns; a call of
    another geometry: the columns."""
    from gradhooks.rules.conv import ConvWeight

    def piece(conv, x):
        with torch.no_grad():
            return ConvWeight(conv, x, torch.randn_like(conv(x)))

    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    same = nn.Conv2d(8, 8, 3, padding=1).double()
    assert piece(same, x).positions_gram(piece(same, x)) is not None
    pointwise = nn.Conv2d(8, 8, 1, stride=2).double()
    x8 = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    assert piece(pointwise, x8).positions_gram(piece(pointwise, x8)) is None
    other = nn.Conv2d(8, 8, 3, padding=1, dilation=1, stride=1).double()
    assert piece(same, x).positions_gram(piece(other, x[:, :, :3, :3])) is None


# -- Conv1d / Conv3d sweeps, ConvTranspose1d/2d/3d -------------------------------------------

TRANSPOSE = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@pytest.mark.parametrize("dims", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=12)
@given(data=st.data(), batch=st.sampled_from([1, 3]))
def test_conv1d_conv3d_sweep(dims, reduction, data, batch):
    case = data.draw(conv_cases(dims))
    if _valid(case):
        check(case, batch=batch, reduction=reduction)


@st.composite
def transpose_cases(draw, dims):
    groups = draw(st.sampled_from([1, 2]))
    in_ch = groups * draw(st.integers(1, 2))
    out_ch = groups * draw(st.integers(1, 2))
    per_dim = lambda s: st.tuples(*[s] * dims)  # noqa: E731
    kernel = draw(per_dim(st.integers(1, 3)))
    stride = draw(per_dim(st.integers(1, 3)))
    dilation = draw(per_dim(st.integers(1, 2)))
    padding = draw(per_dim(st.integers(0, 2)))
    # torch: output_padding < max(stride, dilation) in every dimension
    output_padding = tuple(
        draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation, strict=True)
    )
    bias = draw(st.booleans())
    size = draw(st.integers(2, 4)) if dims < 3 else draw(st.integers(2, 3))
    kwargs = dict(
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        output_padding=output_padding,
        groups=groups,
        bias=bias,
    )
    return Case(
        f"convtranspose{dims}d({in_ch}, {out_ch}, {kwargs})",
        lambda: TRANSPOSE[dims](in_ch, out_ch, **kwargs),
        lambda b: torch.randn(b, in_ch, *(size,) * dims),
    )


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=12)
@given(data=st.data(), batch=st.sampled_from([1, 3]))
def test_conv_transpose_sweep(dims, reduction, data, batch):
    case = data.draw(transpose_cases(dims))
    if _valid(case) and case.model()(case.inputs(1)).numel():
        check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, stride=2, padding=1, output_padding=1),
        dict(kernel_size=2, stride=1, dilation=3, output_padding=2),  # output_padding >= stride
        dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0), groups=2, bias=False),
        dict(kernel_size=4, stride=2, padding=1, groups=4),  # depthwise
    ],
    ids=str,
)
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv_transpose2d_named(kwargs, batch, reduction):
    case = Case(
        f"convtranspose2d{kwargs}",
        lambda: nn.ConvTranspose2d(4, 8, **kwargs),
        lambda b: torch.randn(b, 4, 4, 3),
    )
    check(case, batch=batch, reduction=reduction)


class Upsample(nn.Module):
    """A ConvTranspose2d called with ``output_size`` (which picks the output padding)."""

    def __init__(self, size):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=3, padding=1)
        self.size = size

    def forward(self, x):
        return self.up(x, output_size=self.size)


@pytest.mark.parametrize("size", [(7, 8), (9, 9)], ids=str)
def test_conv_transpose_output_size(size):
    case = Case(f"output_size={size}", lambda: Upsample(size), lambda b: torch.randn(b, 3, 3, 3))
    check(case, batch=3, reduction="sum")


def test_conv_transpose_check_rule():
    for dims, module in TRANSPOSE.items():
        m = module(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        assert gradhooks.check_rule(m, torch.randn(3, 2, *(3,) * dims)).ok


def test_conv_transpose_unbatched_input_is_an_error():
    m = nn.ConvTranspose1d(2, 3, 2)
    with gradhooks.add_hooks(m), pytest.raises(gradhooks.UnbatchedInputError):
        m(torch.randn(2, 5)).sum().backward()

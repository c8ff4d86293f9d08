"""The engine's per-call shortcuts give exactly what the general path gives: the leaves of a
call's arguments without pytree (:func:`gradhooks.engine.records.tree_leaves`), tensors
detached without ``tree_map`` (:func:`~gradhooks.engine.records.detach_tree`), and the hooks'
own work kept from the forward's tracker."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_sequence
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import gradhooks
from gradhooks import _torch
from gradhooks.engine.plan import structure_of
from gradhooks.engine.records import (
    args_leaves,
    autocast_off,
    call_precision,
    detach_tree,
    lowest_precision,
    tree_leaves,
    with_fields,
)
from gradhooks.oracle import vmap_grad
from gradhooks.pieces import Outer
from gradhooks.rules.registry import Call
from gradhooks.tracking import tracker as tracker_module
from harness import cpu_only, sum_of_squares

_Pair = collections.namedtuple("_Pair", "first second")
_X = torch.zeros(2, 3, requires_grad=True)
_P = nn.Parameter(torch.ones(3))

# leaves of every kind the shortcut takes as leaves, and some it hands to pytree
_leaves = st.sampled_from(
    [_X, _P, torch.ones(1), None, 0, 2.5, True, 1j, "mean", torch.float32, torch.device("cpu")]
)


def _nodes(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=4),
        st.tuples(children, children).map(lambda ab: _Pair(*ab)),
        st.lists(st.integers(0, 4), max_size=3).map(torch.Size),
        st.dictionaries(st.sampled_from("xyz"), children, max_size=3).map(collections.OrderedDict),
    )


_trees = st.recursive(_leaves, _nodes, max_leaves=12)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and x == y) for x, y in zip(a, b))


@settings(max_examples=300, deadline=None)
@given(_trees)
def test_tree_leaves_are_pytrees(tree):
    assert _same(tree_leaves(tree), tree_flatten(tree)[0])


@pytest.mark.parametrize(
    "tree",
    [
        _X,
        (_X, 3, None),
        ({"b": _X, "a": [_P, (2, "s")]},),
        {"z": 1, "a": _X},  # (insertion order, as pytree)
        (pack_sequence([torch.ones(3), torch.ones(2)]), {"lengths": torch.Size([3, 2])}),
        _Pair(_X, [_P]),
    ],
    ids=["tensor", "tuple", "nested", "dict-order", "packed", "namedtuple"],
)
def test_tree_leaves_of_usual_calls(tree):
    assert _same(tree_leaves(tree), tree_flatten(tree)[0])


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_detach_tree_is_tree_map(tree):
    got = detach_tree(tree)
    want = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert type(g) is type(w)
        if isinstance(g, torch.Tensor):
            assert not g.requires_grad and g.data_ptr() == w.data_ptr()
        else:
            assert g is w or g == w


class _Names(TorchFunctionMode):
    """The torch functions a plain forward calls, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("off", [False, True], ids=["popped", "paused"])
@pytest.mark.parametrize(
    "positions, detached",
    [
        (None, False),
        ((6,), False),
        pytest.param((6,), True, marks=cpu_only("a Linear runs detached on the CPU alone")),
        pytest.param((2, 3), True, marks=cpu_only("a Linear runs detached on the CPU alone")),
    ],
    ids=["rows", "positions", "positions-detached", "positions-2d-detached"],
)
def test_the_tracker_sees_the_models_functions_only(monkeypatch, positions, detached, off):
    """The forward's tracker sees the model's torch functions, and not the hooks' own work
    (their ``.dim()``, ``.detach()``, ``register_hook``, a rule's checks): taken off torch's
    mode stack while they run (:class:`gradhooks.engine.records.OwnWork`), also around calls
    run detached (Linear over many positions), whose detached aliases of the parameters it
    does see made (one ``detach`` per parameter: the use of each by its call). With the
    internal switched off the tracker stays on, paused, and sees the hooks' work pass; the
    grad1 is the oracle's either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(5, *(positions or ()), 4, dtype=torch.float64)
    plain = _Names()
    with plain:
        model(x)
    seen: list[str] = []
    original = tracker_module.Tracker.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(tracker_module.Tracker, "__torch_function__", counted)
    internal = _torch.disabled("mode_stack") if off else contextlib.nullcontext()
    tuning = gradhooks.tuned(sum_grad1_positions=1 if detached else 10**9)
    with internal, tuning, gradhooks.add_hooks(model, loss_reduction="sum"):
        sum_of_squares(model(x)).backward()
        got = {n: p.grad1 for n, p in model.named_parameters()}
    if off:
        assert len(seen) > len(plain.names) + 4 * detached
    else:
        assert seen.count("detach") == 4 * detached  # (2 Linears, 2 parameters each)
        assert [n for n in seen if n != "detach"] == plain.names
    want = vmap_grad(model, sum_of_squares, (x,))
    for n in want:
        torch.testing.assert_close(got[n], want[n])


def test_with_fields_is_dataclasses_replace():
    """A call's record renewed field by field is ``dataclasses.replace``'s, its other fields
    (the rule's memo among them) the very same objects; an unknown field is refused."""
    x = torch.randn(3, 2)
    call = Call(module=nn.Linear(2, 2), inputs=(x,), kwargs={}, output=None, grad_outputs=())
    call.memo["kept"] = 1
    g = torch.randn(3, 2)
    grads = (g,)
    got = with_fields(call, grad_outputs=grads, taps=None)
    want = dataclasses.replace(call, grad_outputs=grads, taps=None)
    assert got == want and got is not call
    assert got.grad_outputs[0] is g and call.grad_outputs == ()
    for f in dataclasses.fields(Call):
        assert getattr(got, f.name) is getattr(want, f.name), f.name
    with pytest.raises(TypeError, match="grad_output"):
        with_fields(call, grad_output=g)


@pytest.mark.parametrize("on", [False, True], ids=["off", "bfloat16"])
def test_autocast_off(on):
    """The hooks' products run without autocast, also inside an autocast block (and nothing
    changes outside one)."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    block = torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()
    with block:
        assert (a @ b).dtype == (torch.bfloat16 if on else torch.float32)
        with autocast_off():
            assert (a @ b).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") == on


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32,), (torch.float64, torch.float64), (torch.int64,), (torch.complex64,),
     (torch.int64, torch.float16), (torch.float32, torch.bfloat16, torch.float64), ()],
    ids=lambda d: "-".join(str(t).removeprefix("torch.") for t in d) or "none",
)  # fmt: skip
def test_call_precision_from_given_leaves(dtypes, autocast):
    """A call's precision from the leaves its hook already has (one dtype: no fold) is the
    one from its arguments and output, in an autocast block or not."""
    args = tuple(torch.zeros(2, dtype=d) for d in dtypes[:-1]) + (3, None)
    output = torch.zeros(2, dtype=dtypes[-1]) if dtypes else None
    leaves = [*tree_flatten(args)[0], *tree_flatten(output)[0]]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = lowest_precision(
            torch.bfloat16 if autocast else None, *{t.dtype for t in leaves if torch.is_tensor(t)}
        )
        assert call_precision(args, output) is want
        assert call_precision(args, output, autocast, leaves) is want


def test_lowest_precision():
    assert lowest_precision() is None
    assert lowest_precision(None, torch.int64, torch.complex64) is None
    assert lowest_precision(torch.float64, torch.float32, None) is torch.float32
    assert lowest_precision(torch.float16, torch.bfloat16, torch.float32) is torch.bfloat16
    assert lowest_precision(torch.float32, torch.float16, torch.int8) is torch.float16


@settings(max_examples=200, deadline=None)
@given(st.lists(_trees, max_size=4).map(tuple), st.dictionaries(st.sampled_from("kqv"), _trees))
def test_args_leaves_are_pytrees(args, kwargs):
    """A call's ``(args, kwargs)`` flattened and put back as pytree does it, with each leaf
    replaced by the one given in its place."""
    leaves, rebuild = args_leaves(args, kwargs)
    want, spec = tree_flatten((args, kwargs))
    assert _same(leaves, want)
    marks = [object() for _ in leaves]
    got = rebuild(marks)
    assert _same(tree_flatten(got)[0], marks)
    assert type(got) is tuple and type(got[0]) is tuple and type(got[1]) is dict
    again = tree_unflatten(list(leaves), spec)
    assert tree_flatten(rebuild(list(leaves)))[1] == tree_flatten(again)[1]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 7)
        self.head.weight = self.emb.weight  # (tied: one parameter, two modules)
        self.again = self.body[0]  # (one module under two names)
        self.scale = nn.Parameter(torch.ones(1))
        self.body[2].bias.requires_grad_(False)
        self.register_module("absent", None)  # (a child slot holding nothing)
        self.body.append(nn.Sequential(self.again, nn.Linear(4, 4)))  # (shared deeper down)


@pytest.mark.parametrize("by_name", [False, True], ids=["ids", "names"])
def test_structure_walks_as_torch_does(by_name):
    """What the hooks were planned for, in one walk: the modules as ``modules()`` gives them
    (with their classes, and a forward replaced on one), the trainable parameters as ``named_parameters()`` does (a tied one once, under its first
    name; a frozen one and a missing bias left out)."""
    model = _Tied()
    want = (
        tuple(i for m in model.modules() for i in (id(m), id(type(m)))),
        tuple(
            n if by_name else (n, id(p), _torch.tensor_impl(p))
            for n, p in model.named_parameters()
            if p.requires_grad
        ),
    )
    assert structure_of(model, by_name) == want
    model.body[0].weight.requires_grad_(False)
    assert structure_of(model, by_name) != want
    model.body[0].weight.requires_grad_(True)
    assert structure_of(model, by_name) == want
    model.head.forward = model.head.forward  # (a forward set on the module itself)
    assert structure_of(model, by_name) != want
    del model.head.forward
    model.head.__class__ = type("Swapped", (nn.Linear,), {})  # (its class swapped)
    assert structure_of(model, by_name) != want


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["sum", "mean"])
@pytest.mark.parametrize("shared", [1, 3], ids=["one-position", "positions"])
def test_bias_grad1_into(shared, scale, accumulate):
    """A bias's piece written into ``grad1``: its output-gradient summed over the shared
    positions, scaled, added to what is there when accumulating (one position: the rows
    themselves, without a sum)."""
    g = torch.randn(5, shared, 4, dtype=torch.float64)
    before = torch.randn(5, 4, dtype=torch.float64)
    out = before.clone()
    Outer(None, g).grad1_into(out, scale, accumulate)
    want = g.sum(1) * scale + (before if accumulate else 0.0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["sum", "mean"])
@pytest.mark.parametrize("shared", [1, 3], ids=["one-position", "positions"])
@pytest.mark.parametrize("groups", [(), (2,)], ids=["plain", "groups"])
def test_weight_grad1_into(groups, shared, scale, accumulate):
    """A weight's piece written into ``grad1`` in place (``[batch, *groups, out, in]``, viewed
    only where its shape is not the one written): ``Σ_s g[b, s]ᵀ a[b, s]``, scaled, added to
    what is there when accumulating."""
    g = torch.randn(5, *groups, shared, 4, dtype=torch.float64)
    a = torch.randn(5, *groups, shared, 3, dtype=torch.float64)
    before = torch.randn(5, *groups, 4, 3, dtype=torch.float64)
    out = before.clone()
    Outer(a, g).grad1_into(out, scale, accumulate)
    want = torch.einsum("b...so,b...si->b...oi", g, a) * scale + (before if accumulate else 0.0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)

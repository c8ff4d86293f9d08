"""The engine's per-call shortcuts give exactly what the general path gives: the leaves of a
call's arguments without pytree (:func:`gradhooks.engine.records.tree_leaves`), tensors
detached without ``tree_map`` (:func:`~gradhooks.engine.records.detach_tree`)."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_sequence
from torch.utils._pytree import tree_flatten, tree_map

from gradhooks.engine.records import detach_tree, tree_leaves

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

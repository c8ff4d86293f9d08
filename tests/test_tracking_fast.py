"""What makes the tracker cheap per torch function, and must change none of its answers:
:class:`TensorMap` (by identity, holding no tensor alive, never confusing a freed tensor with
one that took its id), :func:`facts` (found once per torch function, as the name-by-name answers
say), and the short ways through :meth:`Tracker.__torch_function__`."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks import _torch
from gradhooks.oracle import vmap_grad
from gradhooks.tracking import MIXED, UNKNOWN, Layout, Tracker
from gradhooks.tracking.ops import (
    FREE,
    LIKE,
    METADATA,
    facts,
    facts_named,
    handler_for,
    quick_kind,
)
from gradhooks.tracking.ops.common import is_inplace, op_name
from gradhooks.tracking.ops.names import MAYBE_SAME
from gradhooks.tracking.quick import quick_key
from gradhooks.tracking.tensormap import TensorMap


def test_a_map_finds_tensors_by_identity_not_value():
    m = TensorMap()
    a, b = torch.zeros(3), torch.zeros(3)
    m[a] = "a"
    assert a in m and m.get(a) == "a" and m[a] == "a"
    assert b not in m and m.get(b) is None and m.get(b, 7) == 7
    with pytest.raises(KeyError):
        m[b]
    assert m.get(3) is None and 3 not in m  # (no tensor: found in no map)
    m[b] = "b"
    assert sorted(m.values()) == ["a", "b"] and len(m) == 2
    assert m.pop(a) == "a" and a not in m and m.pop(a, None) is None
    del m[b]
    assert len(m) == 0
    with pytest.raises(KeyError):
        del m[b]


def test_a_map_holds_no_tensor_alive():
    m = TensorMap()
    t = torch.randn(4, requires_grad=True)
    m[t] = Layout(0)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
    assert len(m) == 0 and m.items() == []


def test_a_freed_tensors_entry_is_not_found_by_the_tensor_that_takes_its_id():
    """CPython reuses a freed object's memory, hence its id, for the next object of its size:
    the new tensor must not inherit the freed one's entry."""
    m = TensorMap()
    t = torch.randn(2)
    old = id(t)
    m[t] = Layout(0)
    del t
    new = None
    for _ in range(1000):
        candidate = torch.randn(2)
        if id(candidate) == old:
            new = candidate
            break
        del candidate
    if new is None:
        pytest.skip("no tensor took the freed id")
    assert new not in m and m.get(new) is None
    with pytest.raises(KeyError):
        m[new]
    m[new] = UNKNOWN
    assert m[new] is UNKNOWN and len(m) == 1


def test_a_map_drops_the_entries_of_freed_tensors_as_it_grows():
    m = TensorMap()
    for _ in range(1000):
        m[torch.zeros(1)] = 1  # (each freed at once)
    assert len(m.entries) < 100  # (the dead entries were swept)
    kept = [torch.zeros(1) for _ in range(300)]
    for t in kept:
        m[t] = 2
    assert len(m) == 300 and all(m[t] == 2 for t in kept)


def test_a_trackers_rarely_used_maps_are_made_at_first_use_each_its_own():
    a, b = Tracker(4, {}), Tracker(4, {})
    assert "alone" not in vars(a) and "single" not in vars(a)  # (not built until asked for)
    x = torch.randn(4, 3)
    assert a.alone.get(x) is None and "alone" in vars(a)
    a.alone[x] = ("select", 0)
    assert a.alone is a.alone and a.alone[x] == ("select", 0)
    assert isinstance(b.alone, TensorMap) and x not in b.alone  # (each tracker its own map)
    with pytest.raises(AttributeError):
        a.no_such_map  # noqa: B018


@pytest.mark.parametrize(
    "func",
    [torch.add, torch.Tensor.add_, torch.Tensor.to, torch.Tensor.size, torch.zeros_like,
     torch.Tensor.__setitem__, torch.nn.functional.layer_norm, torch.Tensor.dim],
    ids=lambda f: op_name(f),
)  # fmt: skip
def test_the_facts_of_a_function_are_its_names(func):
    name = op_name(func)
    for off in (False, True):
        with _torch.disabled("op_schema") if off else contextlib.nullcontext():
            f = facts(func)
            assert f is facts(func) and f is facts_named(name)
            assert f.name == name
            assert f.like == (name in LIKE) and f.metadata == (name in METADATA)
            assert f.maybe_same == (name in MAYBE_SAME) and f.free == (name in FREE)
            assert f.inplace == is_inplace(name) and f.handler is handler_for(name)


def test_the_facts_follow_the_schemas_being_read():
    """An operation only the schemas' tags call elementwise has the elementwise handler while
    they are read, and none where they are not (``_torch.disabled``), in either order."""
    for first in (False, True):
        for off in (first, not first):
            with _torch.disabled("op_schema") if off else contextlib.nullcontext():
                assert (facts(torch.special.i1).handler is None) == off
                x = torch.randn(3, 4)
                tracker = Tracker(4, {})
                tracker.set_layout(x, Layout(1))
                with tracker:
                    y = torch.special.i1(x)
                assert tracker.layout(y) == (UNKNOWN if off else Layout(1))


def test_an_operation_that_returns_no_tensor_but_writes_one_is_followed():
    """``buf[:] = x`` returns ``None``: the tracker skips what returns no tensor (a shape, a
    dtype) except where the operation writes its first argument in place."""
    x = torch.randn(4, 3)
    tracker = Tracker(4, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        buf = torch.zeros(4, 3)
        assert x.shape == (4, 3) and x.dim() == 2 and x.dtype is torch.float32
        buf[:] = x
    assert tracker.layout(buf) == Layout(0)


def test_functions_made_afresh_do_not_fill_the_table():
    """A torch function handed to the mode as a new object on each call (a closure) is
    answered by its name, and the table keeps at most a bounded number of functions."""
    from gradhooks.tracking.ops import _FACTS, _MAX_FUNCTIONS

    for _ in range(_MAX_FUNCTIONS + 10):

        def add(*args):
            return torch.add(*args)

        assert facts(add) is facts_named("add")
    assert all(len(table) <= _MAX_FUNCTIONS for table in _FACTS)


def _closing_over(held: torch.Tensor):
    def scaled(x):
        return x * held

    return scaled


def test_the_table_keeps_no_closure_alive(monkeypatch):
    """A torch function that closes over a tensor is answered, and not kept (nor its tensor)."""
    from gradhooks.tracking import ops

    monkeypatch.setattr(ops, "_FACTS", ({}, {}))  # (room left in the table)
    held = torch.randn(3)
    ref = weakref.ref(held)
    scaled = _closing_over(held)
    assert facts(scaled).name == "scaled"
    del scaled, held
    gc.collect()
    assert ref() is None


# -- what the tracker keeps of a call for the next one like it (gradhooks.tracking.memo) ---------


def _followed(fn, *tensors, batch: int = 4, dim: int = 0):
    """The layouts a tracker gives the outputs of ``fn(*tensors)``, the first tensor with the
    batch on dimension ``dim``."""
    tracker = Tracker(batch, {})
    tracker.set_layout(tensors[0], Layout(dim))
    with tracker:
        out = fn(*tensors)
    outs = out if isinstance(out, tuple | list) else (out,)
    return [tracker.layout(o) for o in outs if isinstance(o, torch.Tensor)]


def _mixed_other(x):
    # (the batch's sum in every row: mixed, which torch.where may leave out)
    return x.sum(0, keepdim=True).expand_as(x)


def _fake_quant(x, observer_on):
    # (quantization-aware training's fused fake quantizer: its observer reads the whole batch
    # where observer_on holds 1)
    fq = torch.ao.quantization.FusedMovingAvgObsFakeQuantize()
    obs = fq.activation_post_process
    return torch.fused_moving_avg_obs_fake_quant(
        x, observer_on, fq.fake_quant_enabled, obs.min_val, obs.max_val, fq.scale,
        fq.zero_point, obs.averaging_constant, obs.quant_min, obs.quant_max, fq.ch_axis,
        fq.is_per_channel, fq.is_symmetric_quant,
    )  # fmt: skip


# calls whose layout depends on the values of a tensor argument, each with two such tensors of
# the same shape and dtype: the first's layout is followed (so it could be kept), the second's
# differs
_BY_VALUES = {
    "torch.where taking the mixed branch nowhere, then somewhere": (
        lambda x, c: torch.where(c, x, _mixed_other(x)), torch.ones(4, 3, dtype=torch.bool),
        torch.tensor([[True] * 3] * 3 + [[False] * 3]),
    ),
    "a fake quantizer's observer off, then on": (
        _fake_quant, torch.tensor([0]), torch.tensor([1]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_BY_VALUES))
def test_a_call_whose_layout_depends_on_values_is_followed_afresh(case):
    """The key a call's layouts are kept by holds its tensors' layouts, shapes and dtypes, not
    their values: an operation whose handler reads values (an index's entries, a condition)
    is followed afresh at every call, never given what a call on other values gave."""
    from gradhooks.tracking import memo

    fn, first, second = _BY_VALUES[case]
    x = torch.randn(4, 3)
    memo.clear()
    fresh = [_followed(fn, x, v) for v in (first, second)]
    assert fresh[0] != fresh[1] and fresh[0][0].dim >= 0  # (the values decide: it can fail)
    memo.clear()
    seen = [_followed(fn, x, v) for v in (first, second)]
    assert seen == fresh
    memo.clear()


def test_a_call_like_one_before_is_given_its_layouts(monkeypatch):
    """A call with the same key as one followed before (its function, other arguments, its
    tensors' layouts, shapes and dtypes, the batch) is given the layouts kept from it, without
    its handler; one that differs in any of these is followed afresh."""
    from gradhooks.tracking import memo, propagate, quick, tracker

    calls = []
    real = propagate.propagate_op

    def counted(tr, *args):
        calls.append(args[0].name)
        return real(tr, *args)

    def fn(x):
        return (x.transpose(0, 1) * 2).sum(0)

    for where in (quick, tracker):  # (the long way's callers)
        monkeypatch.setattr(where, "propagate_op", counted)
    memo.clear()
    try:
        first = _followed(fn, torch.randn(4, 3))
        n = len(calls)
        assert n == 3 and len(memo.KEPT) == 3
        assert _followed(fn, torch.randn(4, 3)) == first == [Layout(0)]
        assert len(calls) == n  # (all three from what was kept)
        # another shape, another batch dimension: followed afresh, and right
        assert _followed(fn, torch.randn(3, 4), dim=1) == [MIXED]  # (summed over the batch)
        assert len(calls) == n + 3
        assert _followed(fn, torch.randn(5, 3), batch=5) == [Layout(0)]
        assert len(calls) == n + 6
    finally:
        memo.clear()


def test_an_index_holding_a_tensor_at_any_depth_is_read_afresh():
    """``x[index]`` is kept only where its index holds no tensor, however deep (a tensor in a
    tuple in a tuple): the handler reads an index tensor's values."""
    from gradhooks.tracking import memo

    t = torch.tensor([0, 1])
    assert memo.holds_tensor(((slice(None), (t,)),)) and memo.holds_tensor(slice(t, None))
    assert not memo.holds_tensor((slice(None, 2), None, Ellipsis, [0, 1]))


# -- the short way through Tracker.__torch_function__ (quick.quick_key) -------------------------


def _quick_calls():
    """Calls the short way keys, each ``(func, args, kwargs)``: the first tensor with the batch
    on dimension 0, the others without a layout."""
    x, y, m = torch.randn(4, 6), torch.randn(4, 6), torch.ones(6, 6, dtype=torch.bool)
    w, b = torch.randn(6), torch.randn(6)
    q = torch.randn(4, 2, 3, 5)
    F = torch.nn.functional
    return {
        "view, ints": (torch.Tensor.view, (x, 4, 3, 2), {}),
        "view, a tuple": (torch.Tensor.view, (x, (4, 6)), {}),
        "view, a size": (torch.Tensor.view, (x, torch.Size([2, 12])), {}),
        "add, a tensor without a layout": (torch.add, (x, y), {}),
        "add, a number and alpha": (torch.add, (x, 2.0), {"alpha": 3}),
        "sum, dims and a flag": (torch.Tensor.sum, (x,), {"dim": (0, 1), "keepdim": True}),
        "sum, a flag as a number": (torch.Tensor.sum, (x, 1, True), {}),
        "to, a dtype": (torch.Tensor.to, (x, torch.float64), {}),
        "layer_norm": (F.layer_norm, (x, (6,), w, b, 1e-5), {}),
        "clamp, None": (torch.clamp, (x,), {"min": None, "max": 1.0}),
        "attention, a mask": (
            F.scaled_dot_product_attention,
            (q, q, q),
            {"attn_mask": m[:5, :5], "scale": 0.5},
        ),
        "narrow": (torch.narrow, (x, 1, 1, 2), {}),
        "masked_fill, a mask": (torch.Tensor.masked_fill, (x, m[:4], 0.0), {}),
    }


@pytest.mark.parametrize("case", sorted(_quick_calls()))
def test_the_short_way_keys_a_call_as_memo_does(case):
    """The short way builds :func:`memo.key`'s very tuple (the kept table is one for both
    ways): equal, and of the same hash, for arguments of every kind it takes."""
    from gradhooks.tracking import memo

    func, args, kwargs = _quick_calls()[case]
    op = facts(func)
    tracker = Tracker(4, {})
    tracker.set_layout(args[0], Layout(0))
    assert quick_kind(op)
    parts = quick_key(tracker, op, args, kwargs)
    want = memo.key(op, 4, args, kwargs, tracker.layouts.entries)
    assert isinstance(parts, list) and want is not memo.NO_KEY
    assert tuple(parts) == want and hash(tuple(parts)) == hash(want)


def test_the_short_way_leaves_to_the_long_way_what_it_does_not_key():
    """A list of tensors (``torch.cat``), an ``out=``, a second tensor given to a function
    that reads only its dtype or shape (``x.to(y)``), a tensor with sources, rows picked by an
    index: the long way (``None``); no tensor with a layout: run as it is."""
    from gradhooks.tracking import memo
    from gradhooks.tracking.layout import Owners
    from gradhooks.tracking.quick import UNLAID
    from gradhooks.tracking.sources import Source

    x, y, z = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    tracker = Tracker(4, {})
    tracker.set_layout(x, Layout(0))
    key = functools.partial(quick_key, tracker)
    assert key(facts(torch.cat), ([x, y],), {}) is None
    assert key(facts(torch.add), (x, y), {"out": z}) is None
    assert key(facts(torch.Tensor.to), (x, y), {}) is None
    assert key(facts(torch.add), (y, z), {}) is UNLAID
    tracker.taint(y, frozenset({Source("pos", y.shape)}))
    assert key(facts(torch.add), (x, y), {}) is None
    tracker.set_layout(z, Layout(0, owners=Owners(torch.tensor([0, 1, 1, 3]))))
    assert key(facts(torch.mul), (z, 2.0), {}) is None
    assert memo.key(facts(torch.mul), 4, (z, 2.0), {}, tracker.layouts.entries) is memo.NO_KEY


def _recorded(model, inputs: dict, batch: int, quick: bool, monkeypatch) -> list:
    """Every torch call of two forwards of ``model`` under a tracker (the examples on dimension
    0 of each input), with its outputs' layouts, by the short way or the long way alone."""
    from gradhooks.tracking import memo
    from gradhooks.tracking import tracker as tracking
    from gradhooks.tracking.ops.common import out_tensors

    class Recording(Tracker):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs)
            seen.append((op_name(func), [self.layout(o) for o in out_tensors(out)]))
            return out

    memo.clear()
    monkeypatch.setattr(tracking, "quick_table", tracking.quick_table if quick else dict)
    seen: list = []
    for _ in range(2):  # (the second: the layouts kept from the first)
        tracker = Recording(batch, {})
        for t in inputs.values():
            tracker.set_layout(t, Layout(0))
        with tracker, torch.no_grad():
            model(**inputs)
    memo.clear()
    return seen


def test_the_short_way_gives_every_call_the_layouts_of_the_long_way(monkeypatch):
    """Hugging Face GPT-2 with an attention mask, followed call by call: the short way gives
    each call's outputs the layouts the long way alone gives them, first and from what was
    kept; the first forward's and the second's agree too."""
    from harness import hf

    config = hf("GPT2Config")(
        n_embd=8, n_layer=1, n_head=2, n_positions=8, vocab_size=11, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf("GPT2LMHeadModel")(config).eval()
    ids = torch.randint(11, (3, 5))
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0]])
    inputs = {"input_ids": ids, "attention_mask": mask}
    short = _recorded(model, inputs, 3, True, monkeypatch)
    long = _recorded(model, inputs, 3, False, monkeypatch)
    assert short == long
    half = len(short) // 2
    assert short[:half] == short[half:]
    assert sum(1 for _, lays in short if any(lay is not None for lay in lays)) > 20


class _Rare(nn.Module):
    """A forward that needs the tracker's rarely used maps: its examples reordered and put
    back, taken one by one and stacked again, expanded."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        perm = torch.arange(x.shape[0]).flip(0)
        h = self.a(x[perm])[perm.argsort()]
        h = torch.stack(list(torch.tanh(h).unbind(0)))
        return self.b(h.expand(2, *h.shape)[0])


def _squares(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


@pytest.mark.parametrize("precision", ["float64", "bf16-autocast"])
def test_the_rarely_used_maps_follow_each_step_of_a_training_loop(precision):
    torch.manual_seed(0)
    dtype = torch.float64 if precision == "float64" else torch.float32
    model = _Rare().to(dtype)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision != "float64")
    tol = {} if precision == "float64" else {"atol": 5e-2, "rtol": 5e-2}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x, y = torch.randn(5, 3, dtype=dtype), torch.randn(5, 2, dtype=dtype)
            with autocast:
                want = vmap_grad(model, _squares, x, y)
                opt.zero_grad()
                _squares(model(x), y).backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(
                    p.grad1.to(dtype),
                    want[n].to(dtype),
                    **tol,
                    msg=lambda m, s=step, n=n: f"{s} {n}: {m}",
                )
                torch.testing.assert_close(p.grad1.sum(0).to(dtype), p.grad, **tol)
            opt.step()

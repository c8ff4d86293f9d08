"""The replay of a hooked call's forward work (:meth:`ForwardCapture.replay_usual`) against
the full path, in training loops that change something between two steps under one set of
hooks: a data-dependent branch, another sequence length or batch size, another number of
tokens per expert, a module switched off and on, the model's dtype, autocast, a part run under
``torch.no_grad()``, parameters frozen and unfrozen, a module replaced, the hooks removed and
added again, the same module called twice in a forward on inputs of other shapes.

Every step runs twice, with the replay off and on, and both must keep the very same records of
every hooked call (every field of its ``Call`` and ``CallState``, its layout, the tensors by
value) and give ``grad1`` equal to the per-example loop on a float64 twin. A replay that missed
a change would keep another record at the step it changes, before any number is compared.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_control_flow import BY_ID, train
from torch import Tensor, nn

import gradhooks
from gradhooks.engine import forward
from gradhooks.engine.records import Frame
from gradhooks.oracle import loop_grad
from harness import assert_close

D = torch.float64


# -- the records of a forward, with the replay off or on ------------------------------------------


@contextlib.contextmanager
def recorded(monkeypatch, replay: bool):
    """Within: every hooked call's kept record (the arguments of its ``KeptCall``), in order,
    in ``memory["kept"]``, and how many calls the replay took (``memory["replayed"]``); the
    replay on or off."""
    memory: dict = {"kept": [], "replayed": 0}
    real_kept, real_replay = forward.KeptCall, forward.ForwardCapture.replay_usual

    def kept(*args):
        memory["kept"].append(args)
        return real_kept(*args)

    def replay_usual(self, *args):
        if not replay:
            return forward.FULL
        done = real_replay(self, *args)
        memory["replayed"] += done is not forward.FULL
        return done

    with monkeypatch.context() as m:
        m.setattr(forward, "KeptCall", kept)
        m.setattr(forward.ForwardCapture, "replay_usual", replay_usual)
        yield memory


def same(a, b, where: str) -> None:
    """``a`` and ``b``, two records of one call kept by two runs, are the same: tensors by
    shape, dtype, ``requires_grad`` and value; records field by field; modules by type."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Tensor):
        assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad), where
        assert torch.equal(a, b), f"{where}: other values"
    elif isinstance(a, Frame):
        return  # (the forward it ran in: another one in each run)
    elif isinstance(a, nn.Module):
        return  # (the target's: compared by name)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, (int, float, str, bool, torch.dtype, type(None))):
        assert a == b, f"{where}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b), where


def same_records(off: list, on: list, what: str, one_model: bool = True) -> None:
    """Two runs' records of one step (:func:`recorded`) are the same, call by call
    (``one_model``: both runs of one model, whose modules and tensors in the parameters' slots
    are the very same; else of two models made alike)."""
    assert len(off) == len(on), f"{what}: {len(off)} calls kept without the replay, {len(on)}"
    for i, (a, b) in enumerate(zip(off, on)):
        target, state, call = a[:3]
        where = f"{what}, call {i} ({target.name})"
        assert b[0].name == target.name, f"{where}: another module, {b[0].name}"
        calls = call, b[2]
        if not one_model:  # (the hooked modules by id: those of each model)
            calls = [dataclasses.replace(c, hooked=list(c.hooked.values())) for c in calls]
        same(*calls, f"{where}: call")
        same(state, b[1], f"{where}: state")
        same(a[3:], b[3:], f"{where}: kept")
        for r in (a, b):
            assert r[2].memo is r[0].memo, f"{where}: another memo"
        if one_model:
            assert b[0] is target, f"{where}: another module"
            for n in call.params or {}:  # (the very tensors in the slots, by identity)
                assert b[2].params[n] is call.params[n], f"{where}: another {n}"


# -- a loop whose model changes between steps -----------------------------------------------------


def tokens(b: int, t: int, seed: int, positive: bool) -> Tensor:
    """``[b, t, 3]``, feature 0 positive everywhere (``positive``) or negative at every
    example's first token: a branch on it goes one way for the batch and each example alone."""
    x = torch.randn(b, t, 3, generator=torch.Generator().manual_seed(seed), dtype=D)
    if positive:
        x[..., 0] = x[..., 0].abs() + 0.1
    else:
        x[:, 0, 0] = -1.0
    return x


class Net(nn.Module):
    """Tokens ``[B, T, 3]``, normalized (a rule that keeps what the forward saved); ``mid`` on
    the batch-first tensor, or sequence-first where feature 0 is positive everywhere (the same
    shapes where ``T == B``); ``extra`` where switched on, under ``torch.no_grad()`` where
    asked (a gate: its parameters get no gradient); ``mid`` again on the last token alone
    (``[B, 4]``) where asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.mid = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 4)
        self.extra, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.use_extra, self.gate, self.twice = False, False, False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        if bool((x[..., 0] > 0).all()):
            h = h + torch.tanh(self.mid(h.transpose(0, 1))).transpose(0, 1)
        else:
            h = h + torch.tanh(self.mid(h))
        if self.use_extra and self.gate:
            with torch.no_grad():
                scale = torch.sigmoid(self.extra(h))
            h = h * scale
        elif self.use_extra:
            h = h + torch.tanh(self.extra(h))
        if self.twice:
            h = h + self.mid(h[:, -1]).unsqueeze(1)
        return self.out(h)


def squares(out: Tensor) -> Tensor:
    return 0.5 * out.pow(2).sum()


@dataclass
class Change:
    """One step: its input, what changes before it (on the model), the context its forward
    runs in, and whether the hooks are removed and added again before it."""

    x: Tensor
    setup: Callable[[nn.Module], None] | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    rehook: bool = False


def flags(**values) -> Callable[[nn.Module], None]:
    return lambda m: [setattr(m, k, v) for k, v in values.items()]


def frozen(name: str, yes: bool) -> Callable[[nn.Module], None]:
    return lambda m: m.get_parameter(name).requires_grad_(not yes)


def replaced(m: nn.Module) -> None:
    torch.manual_seed(1)
    m.mid = nn.Linear(4, 4).to(m.inp.weight.dtype)


def run(monkeypatch, changes: list[Change], tol: dict | None = None) -> int:
    """Each step of ``changes`` with the replay off, then on, on one model under one set of
    hooks: the same records, and ``grad1`` as the loop's on a float64 twin. Returns how many
    calls the replay took."""
    model = Net().double()
    hooks = gradhooks.add_hooks(model, loss_reduction="sum")
    taken = 0
    for k, change in enumerate(changes):
        what = f"step {k}"
        if change.setup is not None:
            change.setup(model)
        if change.rehook:
            hooks.remove()
            hooks = gradhooks.add_hooks(model, loss_reduction="sum")
        dtype = model.inp.weight.dtype
        x = change.x.to(dtype)
        twin = copy.deepcopy(model).double()
        want = loop_grad(twin, squares, change.x)
        runs = []
        for replay in (False, True):
            model.zero_grad()
            hooks.clear()
            with recorded(monkeypatch, replay) as memory:
                with change.context():
                    out = model(x)
                squares(out.float() if out.dtype != dtype else out).backward()
            check_grad1(model, want, f"{what}, replay {replay}", tol)
            runs.append(memory)
        same_records(runs[0]["kept"], runs[1]["kept"], what)
        assert not runs[0]["replayed"]
        taken += runs[1]["replayed"]
    hooks.remove()
    return taken


def check_grad1(model: nn.Module, want: dict, what: str, tol: dict | None) -> None:
    """Each parameter the step reached has ``grad1`` as ``want``; one it did not (frozen,
    switched off, run under ``no_grad``) has none, and the loop gives it nothing either."""
    reached = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            assert not hasattr(p, "grad1"), f"{what}: {n} has a grad1 the step did not reach"
            assert n not in want or not want[n].any(), f"{what}: the loop reaches {n}"
        else:
            reached[n] = want[n]
    assert reached, what
    for n, p in model.named_parameters():
        if n in reached and tol is None:
            assert_close(p.grad1, reached[n], f"{what}: {n}")
        elif n in reached:
            torch.testing.assert_close(p.grad1.to(D), reached[n], **tol, msg=f"{what}: {n}")


F32 = {"rtol": 1e-4, "atol": 1e-5}
BF16 = {"rtol": 5e-2, "atol": 5e-2}


def test_a_branch_on_the_data_moves_the_examples(monkeypatch):
    """``mid`` given ``[B, T, 4]`` or ``[T, B, 4]`` with ``T == B``: the same shapes, the
    examples on another dimension."""
    signs = [True, True, False, True, False, False]
    assert run(monkeypatch, [Change(tokens(3, 3, k, s)) for k, s in enumerate(signs)])


def test_other_sequence_lengths_and_batch_sizes(monkeypatch):
    shapes = [(3, 4), (3, 4), (3, 2), (2, 2), (4, 1), (1, 3), (3, 4)]
    changes = [Change(tokens(b, t, k, False)) for k, (b, t) in enumerate(shapes)]
    assert run(monkeypatch, changes)


def test_a_module_switched_off_and_on_and_run_under_no_grad(monkeypatch):
    setups = [None, flags(use_extra=True), None, flags(gate=True), None, flags(gate=False),
              flags(use_extra=False), flags(use_extra=True)]  # fmt: skip
    changes = [Change(tokens(3, 2, k, False), setup=s) for k, s in enumerate(setups)]
    assert run(monkeypatch, changes)


def test_the_same_module_called_twice_on_other_shapes(monkeypatch):
    setups = [None, flags(twice=True), None, flags(twice=False), flags(twice=True)]
    changes = [Change(tokens(3, 3, k, k % 2 == 0), setup=s) for k, s in enumerate(setups)]
    assert run(monkeypatch, changes)


def test_parameters_frozen_and_unfrozen(monkeypatch):
    setups = [None, frozen("mid.weight", True), None, frozen("mid.bias", True),
              frozen("mid.weight", False), frozen("mid.bias", False), None]  # fmt: skip
    changes = [Change(tokens(2, 3, k, False), setup=s) for k, s in enumerate(setups)]
    assert run(monkeypatch, changes)


def test_a_module_replaced_and_the_hooks_added_again(monkeypatch):
    changes = [
        Change(tokens(2, 3, 0, False)),
        Change(tokens(2, 3, 1, False)),
        Change(tokens(2, 3, 2, False), setup=replaced),
        Change(tokens(2, 3, 3, False)),
        Change(tokens(2, 3, 4, False), rehook=True),
        Change(tokens(2, 3, 5, False)),
    ]
    assert run(monkeypatch, changes)


def test_the_model_cast_to_another_dtype(monkeypatch):
    setups = [None, None, lambda m: m.float(), None, lambda m: m.double(), None]
    changes = [Change(tokens(3, 2, k, False), setup=s) for k, s in enumerate(setups)]
    assert run(monkeypatch, changes, tol=F32)


def test_autocast_on_and_off(monkeypatch):
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    contexts = [contextlib.nullcontext, contextlib.nullcontext, autocast, contextlib.nullcontext,
                autocast, autocast, contextlib.nullcontext]  # fmt: skip
    changes = [Change(tokens(3, 2, k, False), context=c) for k, c in enumerate(contexts)]
    changes[0].setup = lambda m: m.float()
    assert run(monkeypatch, changes, tol=BF16)


@pytest.mark.parametrize(
    "name", ["tokens-per-expert", "layers-skipped-or-twice", "sources-some-steps", "batch-size"]
)
def test_the_control_flow_loops_keep_the_same_records(monkeypatch, name):
    """``tests/test_control_flow.py``'s loops (each step checked against the loop there), run
    with the replay off and on: every call kept the same."""
    kept = []
    for replay in (False, True):
        with recorded(monkeypatch, replay) as memory:
            s = BY_ID[name]
            assert train(s) == len(s.steps())
        kept.append(memory)
    same_records(kept[0]["kept"], kept[1]["kept"], name, one_model=False)
    assert kept[1]["replayed"] and not kept[0]["replayed"]

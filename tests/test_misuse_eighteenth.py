"""Mistakes in a training loop, an eighteenth set: threads, wrappers, a model changed after
``add_hooks``, a layer run on more than the batch, inputs of unusual layouts, and backwards
restricted to some parameters.

A forward and its backward run in a second thread while the model is hooked, a forward there
backpropagated in the main thread, two threads whose forwards and backwards interleave (of one
batch size: their ``grad1`` add up, as ``.grad`` does; of two: the second backward refused,
naming the parameter and both shapes), a forward with grad on of another batch run in a second
thread between the main thread's forward and backward, a forward started in one thread while
another thread's runs (found: the two were followed in one stack of forwards, the first's
backward refused or, under ``no_grad`` with ``verify=False``, its ``grad1`` mixed in silence;
the second is now refused at once), a ``paused()`` block held open by another
thread (the process's switch: every thread's capture is off, the DP step refused, ``check``
saying so), hooks added in one thread and removed in another, also under bfloat16 autocast
(which is each thread's own); hooks on a model Opacus' ``GradSampleModule`` wraps, or wrapped
by it after; on an ``nn.DataParallel`` or a ``torch.compile`` wrapper, then on the model inside
(refused); a deep copy of the hooked model made inside the block (an EMA copy: not hooked, and
said so); a layer added, a layer deleted, a buffer made a parameter, a bias given to a layer built
without one, or a parametrization registered after ``add_hooks``; a parameter registered on a
layer and used outside it (refused, naming the layer and the parameter); a parameter shared
by two layers of different rules (an embedding tied to the output, a conv's and a linear's
bias); a layer's ``forward``
called directly, past its hooks; an encoder run on the batch and on class prototypes (of
another size, or of the batch's), or on a second batch (refused); two views of the batch in one
loss and two losses given to ``torch.autograd.backward`` at once; ``channels_last``, transposed
and expanded inputs, inputs that require grad or are parameters, a mask with no batch given
before the batch by keyword (refused; the message now names the input the batch was taken
from and says to pass the batch first) and the batch given first; a
backward restricted by ``inputs=`` or ``torch.autograd.grad`` over some of the parameters; a
backward with ``create_graph=True`` or under anomaly detection. Each gives the documented
meaning, compared in float64 with each example's own gradient by the per-example loop
(:func:`gradhooks.oracle.loop_grad`; within bfloat16's rounding under autocast), or stops with
the typed error of its kind, whose message names the module or the parameter and the shapes,
leaving the parameters, ``.grad``, ``grad1`` and the hooks as they were
(``tests/test_misuse.py`` to ``tests/test_misuse_seventeenth.py`` hold the earlier sets).
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import close, flat_norms, near
from test_misuse_seventeenth import MAX_NORM, Smoothed, _assert_loop, _assert_step, _batch, _loop
from torch import nn
from torch.nn.utils import parametrize

import gradhooks
from gradhooks.oracle import loop_grad
from harness import HOOKS, assert_untouched, model_state, one_thread, raised

D = torch.float64
LOW = 3e-2  # bfloat16's rounding, relative to a gradient's largest entry
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def _hook_counts(model: nn.Module) -> list[int]:
    """How many hooks of each kind every module holds."""
    return [len(getattr(m, kind)) for m in model.modules() for kind in HOOKS]


def _assert_near(model: nn.Module, want: dict, what: str) -> None:
    """Every parameter's ``grad1`` (of a bfloat16 autocast run) within bfloat16's rounding of
    the float64 loop's, and reducing to ``.grad``."""
    for n, p in model.named_parameters():
        near(p.grad1, want[n], LOW, f"{what}: {n}")
        near(p.grad1.mean(0), p.grad.double(), LOW, f"{what}: {n} vs .grad")


def _in_thread(work) -> None:
    """Runs ``work()`` in a second thread, and raises there what it raised."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 (given back to the main thread)
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if caught:
        raise caught[0]


def _autocast(low: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if low else contextlib.nullcontext()


# -- threads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("low", [False, True], ids=["float64", "bfloat16 autocast"])
def test_a_forward_and_its_backward_in_a_second_thread_are_the_loops(low):
    """The whole step (forward, loss, backward) run in a thread of its own while the model is
    hooked in the main one, in float64 or under bfloat16 autocast entered in that thread:
    ``grad1`` and the norms are the loop's."""
    model = Smoothed() if not low else Smoothed().float()
    x, y = _batch(0)
    want = _loop(Smoothed(), x, y)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:

        def step():
            with _autocast(low):
                out = model(x if not low else x.float())
            F.cross_entropy(out.float() if low else out, y).backward()

        _in_thread(step)
        if low:
            _assert_near(model, want, "in a second thread, bfloat16")
            near(h.norms(), flat_norms(want), LOW, "the norms")
        else:
            _assert_loop(model, want, "in a second thread")
            close(h.norms(), flat_norms(want), "the norms")


def test_a_forward_in_a_second_thread_backpropagated_in_the_main_one():
    """The forward run in a worker thread (a prefetching loader that also runs the model), its
    loss backpropagated in the main thread: ``grad1`` is the loop's, and the next step, all in
    the main thread, too."""
    model = Smoothed()
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = _batch(step)
            want = _loop(model, x, y)
            model.zero_grad()
            outs: list[torch.Tensor] = []
            if step == 0:
                _in_thread(lambda x=x, outs=outs: outs.append(model(x)))
            else:
                outs.append(model(x))
            F.cross_entropy(outs[0], y).backward()
            _assert_loop(model, want, f"step {step}")


def _interleaved(model, first, second) -> tuple[dict, BaseException | None]:
    """Thread A runs ``model`` on ``first``, then thread B on ``second``; A backpropagates,
    then B. Returns the model's state after A's backward and what B's backward raised."""
    (xa, ya), (xb, yb) = first, second
    a_ran, b_ran, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict = {}

    def a() -> None:
        out = model(xa)
        a_ran.set()
        b_ran.wait()
        F.cross_entropy(out, ya).backward()
        seen["after a"] = model_state(model)
        a_done.set()

    def b() -> None:
        a_ran.wait()
        out = model(xb)
        b_ran.set()
        a_done.wait()
        try:
            F.cross_entropy(out, yb).backward()
        except gradhooks.GradhooksError as e:
            seen["b raised"] = e

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    return seen["after a"], seen.get("b raised")


def test_two_threads_whose_forwards_and_backwards_interleave_add_up():
    """Two threads stepping one hooked model (A's forward, B's forward, A's backward, B's
    backward), without ``zero_grad`` between: each forward's backward is its own batch's, so
    ``grad1`` holds the two batches' per-example gradients added row by row, as ``.grad`` holds
    their sum (the loop's of each)."""
    model = Smoothed()
    first, second = _batch(0), _batch(1)
    want_a, want_b = _loop(model, *first), _loop(model, *second)
    with gradhooks.add_hooks(model):
        _, raised_b = _interleaved(model, first, second)
        assert raised_b is None, raised_b
        _assert_loop(model, {n: want_a[n] + want_b[n] for n in want_a}, "A's and B's")


def test_two_threads_of_two_batch_sizes_interleaved_refuse_the_second_backward():
    """The same interleaving with a batch of 5 in A and of 3 in B: B's backward would add rows
    of another batch to A's; it is refused with a ``StateError`` naming the parameter and both
    shapes, and the model is left as A's backward left it (``grad1`` the loop's of A's batch).
    After ``zero_grad`` and ``clear``, B's batch alone is the loop's."""
    model = Smoothed()
    first, second = _batch(0), _batch(1, n=3)
    want_a, want_b = _loop(model, *first), _loop(model, *second)
    with gradhooks.add_hooks(model) as h:
        after_a, refused = _interleaved(model, first, second)
        assert type(refused) is gradhooks.StateError, refused
        for part in ["'head.weight'", "(5, 3, 6)", "(3, 3, 6)", "clear()"]:
            assert part in str(refused), (part, str(refused))
        assert_untouched(model, after_a)
        _assert_loop(model, want_a, "A's, kept")
        model.zero_grad()
        h.clear()
        F.cross_entropy(model(second[0]), second[1]).backward()
        _assert_loop(model, want_b, "B's batch alone")


@pytest.mark.parametrize("low", [False, True], ids=["float64", "bfloat16 autocast"])
def test_a_forward_of_another_batch_in_a_second_thread_between_forward_and_backward(low):
    """Between the main thread's forward and its backward, another thread runs the model with
    grad on on a batch of 3 (a monitor scoring examples, never backpropagated); under bfloat16
    autocast in the main thread, the other thread's forward runs in float32 (autocast is each
    thread's own). The main backward's ``grad1`` is the loop's of its batch."""
    model = Smoothed() if not low else Smoothed().float()
    x, y = _batch(0)
    other, _ = _batch(1, n=3)
    want = _loop(Smoothed(), x, y)
    with gradhooks.add_hooks(model):
        with _autocast(low):
            out = model(x if not low else x.float())
            scored: list[torch.Tensor] = []
            _in_thread(lambda: scored.append(model(other if not low else other.float())))
        assert scored[0].dtype == (torch.float32 if low else D)
        F.cross_entropy(out.float() if low else out, y).backward()
        if low:
            _assert_near(model, want, "another thread's forward between")
        else:
            _assert_loop(model, want, "another thread's forward between")


class Gated(Smoothed):
    """:class:`Smoothed` whose forward, in a thread named in ``gates``, waits between its two
    layers until that thread's gate (an event) is opened, ``inside[name]`` set when it gets
    there."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}
        self.inside: dict[str, threading.Event] = {}

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        name = threading.current_thread().name
        if name in self.gates:
            self.inside[name].set()
            self.gates[name].wait(timeout=10)
        return self.head(h)


SECOND_CALLS = {
    "the model": lambda m, x: m(x),
    "the model under no_grad": lambda m, x: torch.no_grad()(m)(x),
    "one layer called on its own": lambda m, x: m.l1(x),
}


@pytest.mark.parametrize("ends", ["before the first", "after the first"])
@pytest.mark.parametrize("second", list(SECOND_CALLS))
def test_a_forward_started_while_another_threads_forward_runs_is_refused(second, ends):
    """Thread A's forward is half done (its first layer ran) when thread B runs the model,
    under ``torch.no_grad()`` or not, or calls ``model.l1`` on its own, B's forward to end
    before A's or after it: the two cannot be told apart in the one stack of forwards (found:
    where B's ended after A's, A's end took B's place, torch stopped B with a
    ``RuntimeError`` from the tracker entered in one thread and left in the other, and A's
    backward was refused, or, under ``no_grad`` with ``verify=False``, its ``grad1`` mixed in
    silence). B's call is now refused at once with a ``StateError`` naming the module called
    and saying to run the forwards one after the other, nothing changed; A's forward runs on,
    and its backward, and the next step, are the loop's."""
    model = Gated()
    x, y = _batch(0)
    other, _ = _batch(1, n=3)
    want = _loop(Smoothed(), x, y)
    outs: list[torch.Tensor] = []
    refused: list[BaseException] = []

    def b() -> None:
        try:
            SECOND_CALLS[second](model, other)
        except gradhooks.GradhooksError as e:
            refused.append(e)

    for name in ("A", "B"):
        model.gates[name], model.inside[name] = threading.Event(), threading.Event()
    with gradhooks.add_hooks(model, verify=False):
        a = threading.Thread(target=lambda: outs.append(model(x)), name="A")
        a.start()
        try:
            assert model.inside["A"].wait(timeout=10)
            before = model_state(model)
            tb = threading.Thread(target=b, name="B")
            tb.start()
            if ends == "before the first":
                model.gates["B"].set()
                tb.join()
                model.gates["A"].set()
            else:
                while tb.is_alive() and not model.inside["B"].wait(timeout=0.01):
                    pass  # (B refused, or waiting at its gate)
                model.gates["A"].set()
                a.join()
                model.gates["B"].set()
                tb.join()
        finally:
            for gate in model.gates.values():
                gate.set()
            a.join()
        model.gates.clear()
        assert len(refused) == 1, "B's call went through"
        assert type(refused[0]) is gradhooks.StateError, refused[0]
        named = "'l1' (Linear)" if second == "one layer called on its own" else "(Gated)"
        for part in [named, "another", "one after the other"]:
            assert part in str(refused[0]), (part, str(refused[0]))
        assert_untouched(model, before)
        F.cross_entropy(outs[0], y).backward()
        _assert_loop(model, want, "A's forward, run on")
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the next forward")


@contextlib.contextmanager
def _paused_in_another_thread(pause):
    """A second thread holding ``with pause():`` open for the length of the block."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with pause():
            inside.set()
            leave.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    try:
        yield
    finally:
        leave.set()
        t.join()


@pytest.mark.parametrize("switch", ["gradhooks.paused()", "h.paused()"])
def test_a_paused_block_held_open_by_another_thread_pauses_every_threads_capture(switch):
    """``gradhooks.paused()`` (or the handle's ``h.paused()``) is the process's switch, not a
    thread's: while another thread holds it open (an evaluation thread), the main thread's DP
    step captures nothing and is refused with a ``StateError`` naming the parameters, nothing
    written, and its plain backward writes no ``grad1`` (the last backward's stays), which
    ``check`` reports for every parameter. Once the block is closed, both are the loop's."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        pause = gradhooks.paused if switch == "gradhooks.paused()" else h.paused
        with _paused_in_another_thread(pause):
            before = model_state(model)
            raised(
                gradhooks.StateError,
                ["'l1.weight', 'l1.bias', 'head.weight', 'head.bias'", "captured no per-example"],
                lambda: gradhooks.dp_sgd_step(
                    h, F.cross_entropy(model(x), y, reduction="none"), max_norm=MAX_NORM,
                    noise_multiplier=0.0,
                ),
            )  # fmt: skip
            assert_untouched(model, before)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the block closed")
        model.zero_grad()
        other = _batch(1)
        with _paused_in_another_thread(pause):
            F.cross_entropy(model(other[0]), other[1]).backward()
        for n, p in model.named_parameters():
            close(p.grad1, want[n], f"{n}: the last captured backward's")
        report = h.check(raise_on_error=False)
        assert not report.ok
        for n, _ in model.named_parameters():
            assert any(f"'{n}'" in s and "not captured" in s for s in report.problems), n
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=MAX_NORM,
            noise_multiplier=0.0,
        )  # fmt: skip
    _assert_step(model, want, "the DP step, the block closed")


def test_hooks_added_in_one_thread_and_removed_in_another_leave_nothing():
    """``add_hooks`` called in a setup thread, the training and ``remove()`` in the main one:
    ``grad1`` is the loop's, and removing the hooks leaves every module without a hook, the
    last backward's ``grad1`` still to be read."""
    model = Smoothed()
    counts = _hook_counts(model)
    x, y = _batch(0)
    want = _loop(model, x, y)
    handles: list[gradhooks.Hooks] = []
    _in_thread(lambda: handles.append(gradhooks.add_hooks(model)))
    F.cross_entropy(model(x), y).backward()
    _assert_loop(model, want, "hooked in another thread")
    handles[0].remove()
    assert _hook_counts(model) == counts
    _assert_loop(model, want, "after remove()")


# -- wrappers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["hooks on the wrapper", "wrapped after add_hooks"])
def test_hooks_beside_opacus_grad_sample_module_give_both_the_loops(order):
    """Opacus' ``GradSampleModule`` around the model and ``add_hooks`` on the wrapper, or the
    model hooked first and wrapped after: both libraries' per-example gradients (``grad1`` and
    Opacus' ``grad_sample``) are the loop's, and removing gradhooks' hooks leaves Opacus' as
    they were, and the model's calls through the wrapper capture no more ``grad1``."""
    opacus = pytest.importorskip("opacus")
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    if order == "hooks on the wrapper":
        wrapped = opacus.GradSampleModule(model)
        theirs = _hook_counts(model)
        h = gradhooks.add_hooks(wrapped)
    else:
        h = gradhooks.add_hooks(model)
        wrapped = opacus.GradSampleModule(model)
        theirs = None
    with h:
        F.cross_entropy(wrapped(x), y).backward()
        _assert_loop(model, want, order)
        for n, p in model.named_parameters():
            close(p.grad_sample, want[n], f"Opacus' grad_sample of {n}")
    if theirs is not None:
        assert _hook_counts(model) == theirs, "Opacus' hooks changed"
    model.zero_grad()
    F.cross_entropy(wrapped(_batch(1, n=3)[0]), _batch(1, n=3)[1]).backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], f"{n}: the last captured backward's, after remove()")


@pytest.mark.parametrize("wrapper", ["DataParallel", "torch.compile"])
def test_hooks_on_a_wrapper_then_on_the_model_inside_are_refused(wrapper):
    """``add_hooks`` on an ``nn.DataParallel`` (on CPU it runs the model itself) or a
    ``torch.compile`` wrapper: ``grad1`` on the model's parameters is the loop's. Hooking the
    model inside as well is refused with a ``StateError`` naming the layer already hooked,
    nothing changed; and the other way round (the model hooked, then its wrapper) too, its
    calls through the wrapper still the loop's."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)

    def wrap(m):
        return (
            nn.DataParallel(m) if wrapper == "DataParallel" else torch.compile(m, backend="eager")
        )

    wrapped = wrap(model)
    with gradhooks.add_hooks(wrapped):
        F.cross_entropy(wrapped(x), y).backward()
        _assert_loop(model, want, f"hooks on the {wrapper}")
        before = model_state(wrapped)
        raised(gradhooks.StateError, ["'l1' (Linear)", "already hooked"],
               lambda: gradhooks.add_hooks(model))  # fmt: skip
        assert_untouched(wrapped, before)
    model.zero_grad()
    with gradhooks.add_hooks(model):
        before = model_state(model)
        raised(gradhooks.StateError, ["l1' (Linear)", "already hooked"],
               lambda: gradhooks.add_hooks(wrapped))  # fmt: skip
        assert_untouched(model, before)
        F.cross_entropy(wrapped(x), y).backward()
        _assert_loop(model, want, f"the model hooked, called through the {wrapper}")


def test_a_copy_of_the_hooked_model_made_inside_the_block_is_not_hooked():
    """``ema = copy.deepcopy(model)`` inside the ``add_hooks`` block (an EMA copy made after
    the hooks): the copy's forward and backward write no ``grad1`` on it and leave the model's
    as they were; ``hooks_of(ema)`` is refused with a ``ConfigurationError`` naming the copy;
    the model's own backward is the loop's, and the copy, hooked by itself, is the loop's too."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        ema = copy.deepcopy(model)
        before = model_state(model)
        ema.zero_grad()
        F.cross_entropy(ema(_batch(1, n=3)[0]), _batch(1, n=3)[1]).backward()
        assert all("grad1" not in p.__dict__ for p in ema.parameters())
        assert_untouched(model, before)
        raised(gradhooks.ConfigurationError, ["Smoothed", "a copy of a hooked model"],
               lambda: gradhooks.hooks_of(ema))  # fmt: skip
        _assert_loop(model, want, "the model beside its copy")
    with gradhooks.add_hooks(ema):
        ema.zero_grad()
        F.cross_entropy(ema(x), y).backward()
        _assert_loop(ema, want, "the copy hooked")


# -- the model changed after add_hooks --------------------------------------------------------


class Grown(Smoothed):
    """:class:`Smoothed` whose forward runs ``mid`` (a Linear 6 -> 6 and a tanh) where there is
    one, and the head where there is one (the first 3 features otherwise), and adds ``shift``
    (a buffer or a parameter) to the output where there is one."""

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if "mid" in self._modules:
            h = torch.tanh(self.mid(h))
        out = self.head(h) if "head" in self._modules else h[:, :3]
        if hasattr(self, "shift"):
            out = out + self.shift
        return out


def _mid() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(6, 6).to(D)


def test_a_layer_added_after_add_hooks_gets_its_grad1_and_no_hook_is_left():
    """``model.mid = nn.Linear(6, 6)`` set inside the block: it is captured with the others,
    each ``grad1`` the loop's, and once the block ends no module holds a hook."""
    model = Grown()
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        model.mid = _mid()
        want = _loop(model, x, y)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "with mid")
    assert _hook_counts(model) == [0] * len(_hook_counts(model))


def test_a_layer_deleted_after_add_hooks_leaves_the_others_right_and_no_hook_on_it():
    """``del model.head`` inside the block: the rest is the loop's, and once the block ends
    neither the model nor the deleted head (kept by the caller) holds a hook."""
    model = Grown()
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        head = model.head
        del model.head
        want = _loop(model, x, y)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "without the head")
    assert _hook_counts(model) == [0] * len(_hook_counts(model))
    assert _hook_counts(head) == [0] * len(_hook_counts(head)), "the deleted head's hooks"


def test_a_buffer_turned_into_a_parameter_after_add_hooks():
    """A ``shift`` buffer added to the output, made a trainable parameter inside the block (no
    layer's: the model's own, used in its forward): its ``grad1`` and every other are the
    loop's."""
    model = Grown()
    model.register_buffer("shift", torch.zeros(3, dtype=D))
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        value = model.shift
        del model._buffers["shift"]
        model.shift = nn.Parameter(value + 0.1)
        want = _loop(model, x, y)
        F.cross_entropy(model(x), y).backward()
        assert "shift" in want
        _assert_loop(model, want, "the buffer made a parameter")


def test_a_bias_given_to_a_layer_built_without_one_after_add_hooks():
    """``nn.Linear(4, 6, bias=False)``, given ``layer.bias = nn.Parameter(...)`` inside the
    block: its rule sees the bias the layer now uses, and every ``grad1`` is the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 3)).to(D)
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        model[0].bias = nn.Parameter(torch.linspace(-0.2, 0.2, 6, dtype=D))
        want = _loop(model, x, y)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the bias given after")


class Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


def test_a_parametrization_registered_after_add_hooks():
    """``parametrize.register_parametrization(layer, "weight", Symmetric())`` inside the
    block: the trainable parameter is now ``parametrizations.weight.original``, and its
    ``grad1`` (and every other) is the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        parametrize.register_parametrization(model[0], "weight", Symmetric())
        want = _loop(model, x, y)
        assert "0.parametrizations.weight.original" in want
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the weight made symmetric")


class Rescaled(Smoothed):
    """:class:`Smoothed` whose first layer's output is multiplied by ``l1.scale`` where the
    layer has one (a parameter registered on the layer and used outside its forward)."""

    def forward(self, x):
        h = self.l1(x)
        if "scale" in self.l1._parameters:
            h = h * self.l1.scale
        return self.head(torch.tanh(h))


def test_a_parameter_registered_on_a_layer_after_add_hooks_and_used_outside_it_is_refused():
    """``model.l1.register_parameter("scale", ...)`` inside the block, the model multiplying
    the layer's output by it: the Linear's rule knows no ``scale``, so the backward is refused
    with a ``RuleError`` naming the layer and the parameter, nothing changed. Frozen, the
    others' ``grad1`` are the loop's."""
    model = Rescaled()
    x, y = _batch(0)
    with gradhooks.add_hooks(model):
        model.l1.register_parameter("scale", nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=D)))
        before = model_state(model)
        raised(gradhooks.RuleError, ["'l1' (Linear)", "'scale'", "requires_grad_(False)"],
               lambda: F.cross_entropy(model(x), y).backward())  # fmt: skip
        assert_untouched(model, before)
        model.l1.scale.requires_grad_(False)
        want = _loop(model, x, y)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                close(p.grad1, want[n], f"{n}, the scale frozen")
        assert "grad1" not in model.l1.scale.__dict__


class TiedHead(nn.Module):
    """An embedding (7 tokens, 4 features), a Linear and a tanh, and an output Linear whose
    weight is the embedding's (tied), averaged over the 3 tokens: float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid = nn.Embedding(7, 4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight
        self.to(D)

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.emb(ids)))).mean(1)


class SharedBias(nn.Module):
    """A Conv1d (kernel 1, averaged over length 3) and a Linear on the length's mean, added,
    which share one bias: float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.lin = nn.Conv1d(4, 4, 1), nn.Linear(4, 4)
        self.conv.bias = self.lin.bias
        self.to(D)

    def forward(self, x):
        return self.conv(x).mean(2) + self.lin(x.mean(2))


@pytest.mark.parametrize("low", [False, True], ids=["float64", "bfloat16 autocast"])
@pytest.mark.parametrize(
    "shared", ["an embedding tied to the output", "a conv's and a linear's bias"]
)
def test_a_parameter_shared_by_two_layers_of_different_rules(shared, low):
    """One parameter used by two layers whose rules differ (an ``nn.Embedding``'s weight as an
    output ``nn.Linear``'s, a bias shared by an ``nn.Conv1d`` and an ``nn.Linear``): its
    ``grad1`` is the sum of both uses per example, the loop's, in float64 and within
    bfloat16's rounding under autocast."""
    g = torch.Generator().manual_seed(5)
    if shared == "an embedding tied to the output":
        model, x, y = (
            TiedHead(),
            torch.randint(7, (5, 3), generator=g),
            torch.randint(7, (5,), generator=g),
        )
    else:
        model = SharedBias()
        x, y = torch.randn(5, 4, 3, generator=g, dtype=D), torch.randint(4, (5,), generator=g)
    assert len(list(model.parameters())) == 3
    want = _loop(model, x, y)
    if low:
        model = model.float()
        x = x.float() if x.is_floating_point() else x
    with gradhooks.add_hooks(model):
        with _autocast(low):
            out = model(x)
        F.cross_entropy(out.float() if low else out, y).backward()
        if low:
            _assert_near(model, want, shared)
        else:
            _assert_loop(model, want, shared)


class Direct(Smoothed):
    """:class:`Smoothed` whose forward calls ``self.l1.forward(x)``, past the layer's hooks."""

    def forward(self, x):
        return self.head(torch.tanh(self.l1.forward(x)))


def test_a_layers_forward_called_directly_past_its_hooks():
    """``self.l1.forward(x)`` in place of ``self.l1(x)`` (the module's hooks do not run):
    ``grad1`` and the DP step are the loop's all the same."""
    model = Direct()
    x, y = _batch(0)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "l1.forward called directly")
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        norms = gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=MAX_NORM,
            noise_multiplier=0.0,
        )  # fmt: skip
    close(norms, flat_norms(want), "the norms")
    _assert_step(model, want, "the DP step")


# -- a layer run on more than the batch -------------------------------------------------------


class Prototypes(nn.Module):
    """An encoder (Linear 4 -> 6, tanh) run on the batch and on ``k`` fixed class prototypes
    (a buffer ``[k, 4]``); the logits are the encodings' products with the prototypes'."""

    def __init__(self, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 6).to(D)
        g = torch.Generator().manual_seed(7)
        self.register_buffer("prototypes", torch.randn(k, 4, generator=g, dtype=D))

    def forward(self, x):
        return torch.tanh(self.encoder(x)) @ torch.tanh(self.encoder(self.prototypes)).T


@pytest.mark.parametrize("k", [3, 5], ids=["3 prototypes", "as many as the batch"])
def test_an_encoder_run_on_the_batch_and_on_class_prototypes(k):
    """One layer run twice in the forward, on the batch of 5 and on ``k`` prototypes that are
    no example's (3, or 5: as many rows as the batch): each example's gradient goes through
    both calls, and ``grad1`` and the DP step are the loop's."""
    model = Prototypes(k)
    x, _ = _batch(0)
    y = torch.arange(5) % k
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, f"{k} prototypes")
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=MAX_NORM,
            noise_multiplier=0.0,
        )  # fmt: skip
    _assert_step(model, want, f"the DP step, {k} prototypes")


class TwoBatches(Smoothed):
    """:class:`Smoothed` run on the batch and on a second one given beside it."""

    def forward(self, x, extra):
        return super().forward(x), super().forward(extra)


def test_a_second_batch_run_through_the_model_in_the_same_forward_is_refused():
    """A second batch of 3 (a replay buffer) run through the same layers in the forward, its
    loss added to the batch's: its rows are no example of the batch, so the backward is refused
    with a ``BatchNotFoundError`` naming the head and the shape of its output on them, nothing
    changed. One backward per batch is the loop's of each."""
    model = TwoBatches()
    (x, y), (extra, ye) = _batch(0), _batch(1, n=3)
    with gradhooks.add_hooks(model) as h:
        before = model_state(model)
        raised(
            gradhooks.BatchNotFoundError,
            ["'head' (Linear)", "(3, 3)"],
            lambda: sum(F.cross_entropy(o, t) for o, t in zip(model(x, extra), (y, ye))).backward(),
        )
        assert_untouched(model, before)
        for inputs, target in ((x, y), (extra, ye)):
            want = loop_grad(copy.deepcopy(model), lambda o, t: F.cross_entropy(o[0], t),
                             (inputs, inputs), target)  # fmt: skip
            model.zero_grad()
            h.clear()
            F.cross_entropy(model(inputs, inputs)[0], target).backward()
            _assert_loop(model, want, f"a batch of {len(inputs)} alone")


def test_two_views_of_the_batch_in_one_loss():
    """The batch and an augmented view of it (features reversed) through the model, their two
    mean losses added: example ``i``'s gradient is that of its two terms, and ``grad1`` (and
    the DP step of the per-example sums) is the loop's of that sum."""
    model = Smoothed()
    x, y = _batch(0)

    def both(out, target):
        return F.cross_entropy(out[0], target) + F.cross_entropy(out[1], target)

    class Views(nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, x):
            return self.body(x), self.body(x.flip(1))

    views = Views(model)
    want = loop_grad(copy.deepcopy(views), both, (x,), y)
    with gradhooks.add_hooks(views):
        both(views(x), y).backward()
        _assert_loop(views, want, "two views")
    views.zero_grad()
    with gradhooks.add_hooks(views, quantities=("norms",)) as h:
        a, b = views(x)
        losses = F.cross_entropy(a, y, reduction="none") + F.cross_entropy(b, y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=MAX_NORM, noise_multiplier=0.0)
    _assert_step(views, want, "the DP step of two views")


def test_two_losses_given_to_autograd_backward_at_once():
    """``torch.autograd.backward([loss, aux])`` with an auxiliary loss on the hidden features
    (a mean too): ``grad1`` is the loop's of their sum."""
    model = Smoothed()
    x, y = _batch(0)

    def total(out, target):
        return F.cross_entropy(out, target) + 0.1 * out.pow(2).sum(1).mean()

    want = _loop(model, x, y, total)
    with gradhooks.add_hooks(model):
        out = model(x)
        torch.autograd.backward([F.cross_entropy(out, y), 0.1 * out.pow(2).sum(1).mean()])
        _assert_loop(model, want, "two roots")


# -- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("low", [False, True], ids=["float64", "bfloat16 autocast"])
def test_a_channels_last_model_on_channels_last_inputs(low):
    """A convolutional model and its images both in ``torch.channels_last``: ``grad1`` is the
    loop's (of the contiguous model), in float64 and under bfloat16 autocast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(
        D
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 6, 6, generator=g, dtype=D)
    y = torch.randint(3, (5,), generator=g)
    want = _loop(model, x, y)
    model = model.to(memory_format=torch.channels_last)
    x = x.to(memory_format=torch.channels_last)
    if low:
        model, x = model.float(), x.float()
    with gradhooks.add_hooks(model):
        with _autocast(low):
            out = model(x)
        F.cross_entropy(out.float() if low else out, y).backward()
        if low:
            _assert_near(model, want, "channels_last, bfloat16")
        else:
            _assert_loop(model, want, "channels_last")


@pytest.mark.parametrize("layout", ["transposed", "one example expanded", "every other row"])
def test_inputs_that_are_views_of_other_layouts(layout):
    """The batch given as a view that is not contiguous: a ``[4, 5]`` tensor transposed, one
    example expanded to 5 rows (stride 0 along the batch), every other row of a batch of 10:
    ``grad1`` is the loop's (of the same values, contiguous)."""
    g = torch.Generator().manual_seed(2)
    x = {
        "transposed": lambda: torch.randn(4, 5, generator=g, dtype=D).T,
        "one example expanded": lambda: torch.randn(1, 4, generator=g, dtype=D).expand(5, 4),
        "every other row": lambda: torch.randn(10, 4, generator=g, dtype=D)[::2],
    }[layout]()
    assert not x.is_contiguous()
    y = torch.randint(3, (5,), generator=g)
    model = Smoothed()
    want = _loop(model, x.contiguous(), y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, layout)


@pytest.mark.parametrize("how", ["requires_grad", "nn.Parameter"])
def test_inputs_that_require_grad_or_are_parameters(how):
    """The batch made to require grad (an input-gradient saliency map) or given as an
    ``nn.Parameter`` of no module (an adversarial perturbation being learned): ``grad1`` is
    the loop's, and the input's gradient is the one of the model without hooks."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    plain = x.clone().requires_grad_()
    F.cross_entropy(copy.deepcopy(model)(plain), y).backward()
    given = x.clone().requires_grad_() if how == "requires_grad" else nn.Parameter(x.clone())
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(given), y).backward()
        _assert_loop(model, want, how)
    close(given.grad, plain.grad, "the input's gradient")
    assert "grad1" not in given.__dict__


class Keywords(Smoothed):
    """:class:`Smoothed` whose forward takes a ``mask`` of the hidden features (no batch
    dimension) and the batch ``x`` by keyword alone."""

    def forward(self, mask=None, *, x):
        return self.head(torch.tanh(self.l1(x)) * mask)


@pytest.mark.parametrize("size", [6, 5], ids=["a mask of 6", "a mask as long as the batch"])
def test_a_mask_without_a_batch_given_before_the_batch_by_keyword(size):
    """``model(mask, x=x)`` (or ``model(mask=mask, x=x)``): the first tensor input, where
    gradhooks takes the batch from, is a mask of the hidden features with no batch dimension
    (of 6 entries, or of 5, as many as the examples, a model of 5 hidden features). The
    mask's entries taken for the examples, the output mixes them: refused with a
    ``MixedExamplesError`` naming the model, its output's shape and, now, the shape of the
    input the batch was taken from, and saying to pass the batch first; nothing changed.
    ``model(x=x, mask=mask)``, the batch first, is the loop's."""
    model = Keywords()
    if size != 6:
        torch.manual_seed(0)
        model.l1, model.head = nn.Linear(4, size).to(D), nn.Linear(size, 3).to(D)
    x, y = _batch(0)
    mask = torch.linspace(0.0, 1.0, size, dtype=D)
    with gradhooks.add_hooks(model):
        for call in (lambda: model(mask, x=x), lambda: model(mask=mask, x=x)):
            before = model_state(model)
            raised(
                gradhooks.MixedExamplesError,
                ["Keywords", "(5, 3)", f"of shape ({size},)", "pass the batch first"],
                lambda call=call: F.cross_entropy(call(), y).backward(),
            )
            assert_untouched(model, before)
        want = loop_grad(_Bound(copy.deepcopy(model), mask), F.cross_entropy, (x,), y)
        F.cross_entropy(model(x=x, mask=mask), y).backward()
        _assert_loop(model, {n.removeprefix("model."): g for n, g in want.items()}, "x first")


class _Bound(nn.Module):
    """``model(mask, x=x)`` as a module of ``x`` alone (for the loop)."""

    def __init__(self, model: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, x):
        return self.model(x=x, mask=self.mask)


# -- backwards restricted to some parameters, and their modes ---------------------------------


@pytest.mark.parametrize("how", ["backward(inputs=...)", "autograd.grad"])
def test_a_backward_over_some_of_the_parameters_writes_those_alone(how):
    """``loss.backward(inputs=[head.weight])`` or ``torch.autograd.grad(loss,
    [head.weight])``: ``head.weight`` alone gets its ``grad1`` (the loop's); the other
    parameters get neither ``grad1`` nor ``.grad``. The next full backward is the loop's for
    every parameter."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        if how == "autograd.grad":
            (g,) = torch.autograd.grad(loss, [model.head.weight])
            close(model.head.weight.grad1.mean(0), g, "grad1 against the gradient returned")
        else:
            loss.backward(inputs=[model.head.weight])
            close(model.head.weight.grad1.mean(0), model.head.weight.grad, "vs .grad")
        close(model.head.weight.grad1, want["head.weight"], "head.weight")
        for n, p in model.named_parameters():
            if n != "head.weight":
                assert "grad1" not in p.__dict__ and p.grad is None, n
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the full backward after")


@pytest.mark.parametrize("mode", ["create_graph=True", "detect_anomaly"])
def test_a_backward_that_keeps_its_graph_or_runs_under_anomaly_detection(mode):
    """``loss.backward(create_graph=True)`` (left on from a higher-order experiment) or the
    backward under ``torch.autograd.detect_anomaly()``: ``grad1`` and the norms are the
    loop's."""
    model = Smoothed()
    x, y = _batch(0)
    want = _loop(model, x, y)
    anomaly = torch.autograd.detect_anomaly() if mode == "detect_anomaly" else None
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        with anomaly if anomaly is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
            loss.backward(create_graph=mode == "create_graph=True")
        _assert_loop(model, want, mode)
        close(h.norms(), flat_norms(want), "the norms")
    for p in model.parameters():
        p.grad = None  # (a .grad that keeps its graph refers to the parameters)

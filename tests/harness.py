"""One oracle harness for every layer and every quantity.

A :class:`Case` is a model factory, an input factory and a sum-reduced loss. :func:`check`
runs it in float64 through gradhooks and through both oracles (``vmap(grad)`` and a
per-example loop) and asserts that all three agree, and that ``grad1`` reduces to ``.grad``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad

RTOL, ATOL = 1e-7, 1e-9

# GRADHOOKS_TEST_DEVICE_LIKE=1: every test takes the paths gradhooks takes on a GPU
# (conftest.py's device_like fixture, autouse then)
DEVICE_LIKE = os.environ.get("GRADHOOKS_TEST_DEVICE_LIKE", "") not in ("", "0")


def cpu_only(reason: str) -> pytest.MarkDecorator:
    """A mark for a test of what gradhooks does on the CPU alone (a path measured faster there,
    the spot check): skipped with ``GRADHOOKS_TEST_DEVICE_LIKE=1``."""
    return pytest.mark.skipif(DEVICE_LIKE, reason=f"CPU only: {reason}")


def sum_of_squares(out, target=None) -> Tensor:
    """A loss that sums per-example losses and reaches every output tensor."""
    leaves = out if isinstance(out, tuple | list) else (out,)
    return sum(0.5 * (t**2).sum() for t in leaves if isinstance(t, Tensor))


def cross_entropy_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="sum")


@dataclass
class Case:
    id: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int], Tensor | tuple[Tensor, ...]]
    target: Callable[[int], Tensor] | None = None
    loss: Callable[..., Tensor] = sum_of_squares  # sums over the batch

    def __repr__(self) -> str:
        return self.id


def _double(x):
    if isinstance(x, tuple):
        return tuple(_double(t) for t in x)
    return x.double() if isinstance(x, Tensor) and x.is_floating_point() else x


class Between(nn.Module):
    """Two Linear layers (3 to 5 to 2 features) with ``how`` between them: what a test puts
    between two hooked layers (an operation across the batch, one the tracker has no handler
    for)."""

    def __init__(self, how: Callable[[Tensor], Tensor]):
        super().__init__()
        self.how, self.l1, self.l2 = how, nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.how(torch.tanh(self.l1(x))))


class MixedBackward(torch.autograd.Function):
    """The identity forward, a backward that adds the next example's gradient: a mixing of
    the examples that only the backward shows (what the run-time check's probe must catch)."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.roll(1, 0)


def assert_close(got: Tensor, want: Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel():
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), f"{what}: max abs diff {diff:.3e}"


def mlp(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """A small Linear-Tanh-Linear model (3 -> 5 -> 2), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)


def labelled_batch(step: int, n: int = 5, features: int = 3, classes: int = 2):
    """``n`` float64 examples of ``features`` and their labels, drawn from a generator seeded
    with ``step`` (the idiom sets' batch of each step)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    return x, torch.randint(classes, (n,), generator=g)


def labelled_sequences(step: int, n: int = 5, time: int = 6, features: int = 4, classes: int = 3):
    """``n`` float64 sequences of ``time`` steps of ``features`` and a label each, drawn from a
    generator seeded with ``step``."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, time, features, generator=g, dtype=torch.float64)
    return x, torch.randint(classes, (n,), generator=g)


def flat_grads(grads) -> Tensor:
    """Per-example gradients ``{name: [batch, *shape]}`` (or their list) as ``[batch, P]``."""
    rows = grads.values() if isinstance(grads, dict) else grads
    return torch.cat([g.flatten(1) for g in rows], 1)


def grad1_of(model: nn.Module) -> dict[str, Tensor]:
    """Each trainable parameter's ``grad1``, by name."""
    return {n: p.grad1 for n, p in model.named_parameters() if p.requires_grad}


def wide_mlp(out: int = 2) -> nn.Sequential:
    """A Linear-Tanh-Linear model (3 -> 6 -> ``out``) in float64, seeded (the idiom sets')."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, out)).to(torch.float64)


class NormNet(nn.Module):
    """Linear-BatchNorm-Tanh-Linear (3 -> 5 -> 2), seeded: the kind of model SWA's recipe is
    for, and a backbone fine-tuned with its BatchNorm frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def sq(out, target=None):
    """Half the sum of squares: a loss without a target."""
    return 0.5 * out.pow(2).sum()


def assert_matches(model, want: dict, what: str = "", **tol) -> None:
    """Every parameter's ``grad1`` against ``want[name]`` (``assert_close``, or
    ``torch.testing.assert_close`` with the tolerances ``tol``)."""
    for n, p in model.named_parameters():
        if tol:
            torch.testing.assert_close(
                p.grad1, want[n], **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
            )
        else:
            assert_close(p.grad1, want[n], f"{what} {n}")


def assert_grad1(model, want: dict, what: str, frozen_clean: bool = False, **tol) -> None:
    """Every trainable parameter's ``grad1`` is ``want[name]`` (the float64 tolerances of
    :func:`assert_close`, or ``torch.testing.assert_close`` with ``tol``); at least one is
    checked; with ``frozen_clean``, a frozen parameter has no ``grad1``."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            if frozen_clean:
                assert not hasattr(p, "grad1"), f"{what}: frozen {n} has a grad1"
            continue
        assert hasattr(p, "grad1"), f"{what}: {n} has no grad1"
        if tol:
            torch.testing.assert_close(
                p.grad1.to(want[n].dtype), want[n], **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
            )
        else:
            assert_close(p.grad1, want[n], f"{what}: {n}")
        checked += 1
    assert checked, what


def seeded(factory, seed: int = 0):
    """``factory()`` after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return factory()


def as_double(t):
    """``t`` in float64 where it is a floating tensor, else as it is."""
    return t.double() if isinstance(t, Tensor) and t.is_floating_point() else t


def run_hooked(model, case, inputs, target, reduction: str, **hook_kwargs):
    batch = (inputs[0] if isinstance(inputs, tuple) else inputs).shape[0]
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with gradhooks.add_hooks(model, loss_reduction=reduction, **hook_kwargs):
        out = model(*args)
        loss = case.loss(out) if target is None else case.loss(out, target)
        if reduction == "mean":
            loss = loss / max(batch, 1)
        loss.backward()
    return batch


def check(case: Case, batch: int = 4, reduction: str = "mean", seed: int = 0, **hook_kwargs):
    """Assert hooks == vmap(grad) == loop for every trainable parameter, in float64."""
    torch.manual_seed(seed)
    model = case.model().double()
    inputs = _double(case.inputs(batch))
    target = case.target(batch) if case.target else None
    loss = case.loss
    want = vmap_grad(model, loss, inputs, target)
    loop = loop_grad(model, loss, inputs, target)
    run_hooked(model, case, inputs, target, reduction, **hook_kwargs)
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"{case.id}: frozen {name} got a grad1"
            continue
        assert_close(loop[name], want[name], f"{case.id}: loop vs vmap, {name}")
        assert hasattr(p, "grad1"), f"{case.id}: {name} has no grad1"
        assert_close(p.grad1, want[name], f"{case.id} ({reduction}, batch {batch}): {name}")
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        if batch:
            assert_close(reduced, p.grad, f"{case.id}: grad1 reduced vs .grad, {name}")
        checked += 1
    assert checked, f"{case.id}: no trainable parameter was checked"
    return model


# -- Hugging Face models ------------------------------------------------------------------------


def hf(name: str):
    """A transformers class, or a skip that says why it does not import where a torchvision
    wheel built for another torch breaks transformers' model imports; any other failure to
    import is raised."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    try:
        return getattr(transformers, name)
    except Exception as e:  # (transformers wraps the cause in its own error)
        if "torchvision" not in f"{e!r} {e.__cause__!r}":
            raise  # (a broken transformers is a failure, not a skip)
        pytest.skip(f"transformers.{name} does not import here: {type(e).__name__}: {e}")


def tiny_bert_config(**more):
    """A Hugging Face ``BertConfig`` of one layer of width 8 (2 heads), a vocabulary of 20, 16
    positions, no dropout; ``more`` set as well (``num_labels=3``)."""
    return hf("BertConfig")(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        vocab_size=20, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **more,
    )  # fmt: skip


class Logits(nn.Module):
    """A Hugging Face model's logits at the last position (GPT-2) or of the sequence (BERT)."""

    def __init__(self, model, last=True):
        super().__init__()
        self.model, self.last = model, last

    def forward(self, input_ids, attention_mask=None):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, -1] if self.last else logits


def corrupting(add_hooks):
    """``add_hooks`` whose ``grad1`` of one parameter has its first two examples swapped: a
    silently wrong number, which a sweep must report as a mismatch."""

    @contextlib.contextmanager
    def wrong(model, **kwargs):
        with add_hooks(model, **kwargs) as hooks:
            yield hooks
        p = next(p for p in model.parameters() if getattr(p, "grad1", None) is not None)
        order = list(range(p.grad1.shape[0]))
        order[:2] = [1, 0]
        p.grad1 = p.grad1[order]

    return wrong


# -- what a refused call must leave as it was ----------------------------------------------------

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _clone(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def model_state(model: nn.Module) -> dict:
    """What a refused call must leave as it was: parameters, ``.grad``, ``grad1``, hooks."""
    return {
        "params": {n: _clone(p) for n, p in model.named_parameters()},
        "grad": {n: _clone(p.grad) for n, p in model.named_parameters()},
        "grad1": {n: _clone(p.__dict__.get("grad1")) for n, p in model.named_parameters()},
        "hooks": [(n, [len(getattr(m, kind)) for kind in HOOKS]) for n, m in model.named_modules()],
    }


def assert_untouched(model: nn.Module, before: dict) -> None:
    """``model`` as :func:`model_state` found it ``before``."""
    now = model_state(model)
    assert now["hooks"] == before["hooks"], "the hooks changed"
    for what in ("params", "grad", "grad1"):
        for name, was in before[what].items():
            got = now[what][name]
            same = got is None if was is None else got is not None and torch.equal(got, was)
            assert same, f"{what} of {name} changed"


def raised(error: type[Exception], says: str | list[str], call) -> Exception:
    """``call()`` raises exactly ``error`` (not a subclass of it that means something else),
    a gradhooks error whose message holds each of ``says``."""
    with pytest.raises(gradhooks.GradhooksError) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    for part in [says] if isinstance(says, str) else says:
        assert re.search(re.escape(part), str(info.value)), (part, str(info.value))
    return info.value


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, for a module that imports this fixture (autouse there): its models
    are tiny, and threads on a shared machine spend more time waiting for each other than
    computing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class _Param:
    name: str


class OpCall(nn.Module):
    """``op(x, *args, **kwargs)`` with the tensors of ``args`` and ``kwargs`` that require grad
    held as this module's parameters: one of torch's op-database sample inputs as a layer."""

    def __init__(self, op, args: tuple, kwargs: dict):
        super().__init__()
        self.op, self.args, self.kwargs = op, [], {}
        for k, a in enumerate(args):
            self.args.append(self._keep(f"arg{k}", a))
        for name, a in kwargs.items():
            self.kwargs[name] = self._keep(name, a)

    def _keep(self, name: str, a):
        if isinstance(a, Tensor) and a.requires_grad:
            self.register_parameter(name, nn.Parameter(a.detach().clone()))
            return _Param(name)
        return a

    def forward(self, x):
        def get(a):
            return getattr(self, a.name) if isinstance(a, _Param) else a

        return self.op(x, *map(get, self.args), **{n: get(a) for n, a in self.kwargs.items()})

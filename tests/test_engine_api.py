"""The narrow engine API the workflows drive a handle through (``engine_of``): backwards of
their own, told apart from the model's by :meth:`EngineAPI.backward_mode`, and what they read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.engine.api import engine_of
from gradhooks.oracle import loop_grad


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 4, generator=g, dtype=torch.float64), torch.randint(
        3, (batch,), generator=g
    )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def test_a_backward_not_captured_leaves_grad1_and_adds_to_grad():
    model = _model()
    x, y = _data()
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        _loss(model(x), y).backward()
        before = {n: p.grad1.clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with engine_of(h).backward_mode(capture=False):
            (2 * _loss(model(x), y)).backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad1, before[n]), n  # (a captured one would double it)
            torch.testing.assert_close(p.grad, 3 * grads[n])
        assert h.accumulated == 1
        _loss(model(x), y).backward()  # (the mode ends with the block)
        assert h.accumulated == 2
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, 2 * before[n])


def test_the_kept_pieces_give_each_examples_gradient():
    """``keep`` collects each call's pieces; weighted by a one-hot row they are that example's
    gradient (float64, against the per-example loop)."""
    model = _model()
    x, y = _data()
    want = loop_grad(model, _loss, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        kept: list = []
        engine = engine_of(h)
        with engine.backward_mode(param_grads=False, keep=kept):
            _loss(model(x), y).backward()
        assert engine.collector.keep is None  # (put back)
        assert len(kept) == 2  # (one per hooked call)
        for i in range(x.shape[0]):
            weights = torch.zeros(x.shape[0], dtype=x.dtype)
            weights[i] = 1
            found = gradhooks.pieces.weighted_sums(kept, weights)
            for n, p in model.named_parameters():
                torch.testing.assert_close(found[id(p)], want[n][i])
        flat = torch.cat([w.flatten(1) for w in want.values()], 1)
        torch.testing.assert_close(h.norms(), flat.norm(dim=1))


def test_keep_needs_quantities():
    model = _model()
    with gradhooks.add_hooks(model) as h:
        with pytest.raises(gradhooks.ConfigurationError, match="keep"):
            with engine_of(h).backward_mode(keep=[]):
                pass


def test_what_the_workflows_read():
    model = _model()
    x, y = _data()
    with gradhooks.add_hooks(model) as h:
        engine = engine_of(h)
        assert not engine.sharded and not engine.recomputes and not engine.running()
        names = [n for n, _ in engine.named_parameters()]
        assert names == [n for n, _ in model.named_parameters()]
        assert engine.covered() == {id(p) for p in model.parameters()}
        assert {n for n, _ in engine.parameters().values()} == set(names)
        assert engine.written() == []
        _loss(model(x), y).backward()
        assert all(engine.wrote(p) for p in model.parameters())
        assert {id(p) for p in engine.written()} == {id(p) for p in model.parameters()}
        assert all(engine.in_use(p) is p for p in model.parameters())
        h.clear()
        assert engine.written() == []


def test_the_handle_owns_its_parts():
    """``Hooks`` is no mixin: its parts are objects of their own that share one
    ``CaptureState``, and each reaches the others by name."""
    model = _model()
    with gradhooks.add_hooks(model) as h:
        assert gradhooks.Hooks.__bases__ == (object,)
        parts = [h._forwards, h._backwards, h._layouts, h._detached_calls, h._verifier]
        assert len({type(p) for p in parts}) == 5
        assert all(p.state is h._state for p in parts)
        assert h._forwards.backwards is h._backwards and h._verifier.backwards is h._backwards
        assert h._detached_calls.forwards is h._forwards and h._backwards.verifier is h._verifier
        h.verify = False  # (the handle's settings are the state's)
        assert h._state.verify is False and h.verify is False

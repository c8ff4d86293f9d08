"""The short way the engine judges the usual hooked call by (one tensor in, one out, the examples
where the rule reads them: :meth:`gradhooks.engine.calls.CallLayouts._usual_layout`) decides as
the full judgement (:meth:`~gradhooks.engine.calls.CallLayouts.call_layout`) does, at every call
of training loops whose control flow changes from one step to the next under one set of hooks:
a data-dependent branch that moves the examples to another dimension or folds them into the
tokens, another sequence length, another number of tokens per expert (an expert with none),
layers skipped or run twice, a module switched on and off. Each loop also checks every step's ``grad1`` and norms against the
per-example loop in float64 (``tests/test_control_flow.py``'s :func:`train`).

The short way is asked first; where it answers, the same call is judged again the full way and
both answers must be the same (kind, batch, layouts of inputs and outputs, whether the input is
one of the forward's own). A short way that missed a change (a layout taken from the wrong
dimension, a fold taken for plain rows) would disagree here at the step it changes, before any
number is compared.
"""

from __future__ import annotations

import pytest
from test_control_flow import BY_ID, train

from gradhooks.engine import forward
from gradhooks.engine.calls import CallLayouts

# the scenarios of tests/test_control_flow.py whose steps change the calls' layouts, and the
# kinds the short way must have given in each
SCENARIOS = {
    "seq-first-detour": {"plain", "moved"},  # (a Linear given [T, B, C] on some steps)
    "fold-batch-or-sequence": {"plain", "moved"},  # (the examples folded outer, or inner)
    "sequence-length": {"plain"},
    # (the tokens flattened for the router: moved; the experts' rows are picked: the full way's)
    "tokens-per-expert": {"plain", "moved"},
    "layers-skipped-or-twice": {"plain"},
    "sources-some-steps": {"plain"},
}


def _fields(layout) -> tuple:
    return (layout.kind, layout.batch, layout.first, layout.inputs, layout.outputs, layout.root)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_short_way_agrees_with_the_full_judgement(monkeypatch, name):
    short = CallLayouts._usual_layout
    kinds: list[str] = []
    full: list[bool] = []  # (set while the full judgement runs: the short way says nothing)

    def checked(self, target, x, y, tracker):
        if full:
            return None
        got = short(self, target, x, y, tracker)
        if got is not None:
            full.append(True)
            try:
                want = self.call_layout(target, (x,), {}, y, tracker, [x], [y])
            finally:
                full.pop()
            assert _fields(got) == _fields(want), f"{name}, {target.name}: {got} != {want}"
            kinds.append(got.kind)
        return got

    monkeypatch.setattr(CallLayouts, "_usual_layout", checked)
    # (the engine's replay of the usual call, which takes a short way of its own, off: it is
    # checked in tests/test_replay_guard.py)
    monkeypatch.setattr(forward.ForwardCapture, "replay_usual", lambda *a: forward.FULL)
    s = BY_ID[name]
    assert train(s) == len(s.steps())
    assert set(kinds) == SCENARIOS[name], f"{name}: the short way gave {sorted(set(kinds))}"


def test_the_short_way_leaves_the_rest_to_the_full_one(monkeypatch):
    """Where the short way says nothing (the model's own input, rows picked by an index, the
    examples elsewhere than the rule reads them), the full judgement decides: the loops give
    the same numbers with the short way off."""
    monkeypatch.setattr(CallLayouts, "_usual_layout", lambda *a: None)
    for name in ("seq-first-detour", "tokens-per-expert"):
        s = BY_ID[name]
        assert train(s) == len(s.steps())

"""Mistakes and habits of a training loop, a tenth set: ``h.check(loss_fn, x, y)`` (or the
per-example loop ``gradhooks.oracle.loop_grad``) run between the micro-batches of an
accumulation, followed by ``clip_grad_norm_``, a paused backward or a ``.grad`` scaled in
place before the next micro-batch. Each gives the documented meaning, compared in float64 with
each example's own gradient by the per-example loop (:func:`gradhooks.oracle.loop_grad`), or
stops with the typed error (or warning) of its kind, whose message names what was refused
(``tests/test_misuse.py`` to ``tests/test_misuse_eighth.py`` hold the earlier sets)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import close, loop

import gradhooks
from harness import labelled_batch, mlp, one_thread

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def _clip(model, hooks):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _paused_penalty(model, hooks):
    with hooks.paused():  # (a term of the loss left out of grad1, as documented)
        (1e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()


def _halved(model, hooks):
    for p in model.parameters():
        p.grad.div_(2)


def _oracle(model, hooks):
    gradhooks.oracle.loop_grad(model, F.cross_entropy, *labelled_batch(7))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.mark.parametrize(
    "between", [_clip, _paused_penalty, _halved, _oracle],
    ids=["clip_grad_norm_", "paused-backward", "grad-halved-in-place", "loop_grad-then-clip"],
)  # fmt: skip
def test_check_between_micro_batches_then_grad_changed_in_place(between):
    """Two micro-batches accumulated, the first checked with ``h.check(loss_fn, x, y)`` (its
    per-example loop sets each ``.grad`` aside and puts it back), then ``.grad`` changed in
    place before the second: ``clip_grad_norm_``, a backward under ``h.paused()`` adding a
    penalty, ``.grad`` halved, or ``loop_grad`` and a clip. The check's loop was taken for a
    ``zero_grad`` followed by a backward of its own, so the second backward started ``grad1``
    afresh: it held the second micro-batch's rows alone (``accumulated`` 1), silently, at every
    parameter. ``grad1`` is the two micro-batches' rows added up, as documented for each of
    these changes."""
    model = mlp()
    hooks = gradhooks.add_hooks(model)
    x1, y1 = labelled_batch(1)
    x2, y2 = labelled_batch(2)
    F.cross_entropy(model(x1), y1).backward()
    assert hooks.check(F.cross_entropy, x1, y1).ok
    between(model, hooks)
    F.cross_entropy(model(x2), y2).backward()
    assert hooks.accumulated == 2
    first, second = loop(model, x1, y1), loop(model, x2, y2)
    for name, p in model.named_parameters():
        close(p.grad1, first[name] + second[name], f"{name} after {between.__name__}")
    hooks.remove()


def test_a_reset_seen_by_a_paused_backward_still_starts_grad1_afresh():
    """What the check's put-back must not hide: ``zero_grad(set_to_none=False)`` (or the
    default ``zero_grad()``), then a backward under ``h.paused()``, then a captured one. The
    reset was the loop's own: ``grad1`` holds the captured micro-batch's rows alone."""
    for set_to_none in (False, True):
        model = mlp()
        hooks = gradhooks.add_hooks(model)
        x1, y1 = labelled_batch(1)
        x2, y2 = labelled_batch(2)
        F.cross_entropy(model(x1), y1).backward()
        model.zero_grad(set_to_none=set_to_none)
        with hooks.paused():
            F.cross_entropy(model(x1), y1).backward()
        F.cross_entropy(model(x2), y2).backward()
        assert hooks.accumulated == 1
        want = loop(model, x2, y2)
        for name, p in model.named_parameters():
            close(p.grad1, want[name], f"{name}, set_to_none={set_to_none}")
        hooks.remove()

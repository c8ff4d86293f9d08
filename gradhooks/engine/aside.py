"""A gradient that reaches a fallback call's inner tensor aside from its returned tensors.

The fallback recomputes a call of a module without a rule from the tensors it returns, so the
gradient its parameters get through the call's returned tensors is all it gives them. A tensor
the call computed on the way to those (a router's logits, before their softmax) and kept where
the code outside reads it (in a list on the module, held by a function it returns) can also be
given a gradient from there: an auxiliary loss read from it. That share would be left out.

The gradient reaching such a tensor is, in one backward, the sum of what each operation that
reads it sends. The operations the call itself ran are known after its forward (the autograd
nodes between its inputs and its returned tensors); a hook on each takes what it sends to the
tensor, and a hook on the tensor compares, exactly, the gradient it gets with their sum, added
in the order autograd added them. Any other reader's share makes the two differ: the backward
is then refused (:meth:`.backward.BackwardWriter.reached_aside`). A tensor kept only to be
looked at gets what the call's operations send, the same to the last bit. This is an account
of where the gradient came from, not a tolerance: no share smaller than the sum's rounding
goes unseen that would change ``grad1`` by more than that rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .records import graph_task

__all__ = ["follow_aside"]


class _Shares:
    """What the call's own operations sent the kept tensor in the running backward."""

    def __init__(self) -> None:
        self.task = -2
        self.sent: list[Tensor] = []

    def add(self, grad: Tensor | None) -> None:
        task = graph_task()
        if task != self.task:  # (a new backward: what an earlier one sent is not this one's)
            self.task, self.sent = task, []
        if grad is not None:
            self.sent.append(grad)

    def take(self) -> list[Tensor]:
        sent = self.sent if self.task == graph_task() else []
        self.task, self.sent = -2, []
        return sent


def follow_aside(kept: Tensor, inside: set, refuse: Callable[[], None]) -> None:
    """Hooks on ``kept`` and on the autograd nodes of ``inside`` (the call's own, between its
    inputs and its returned tensors) that read it: where, in a backward, ``kept`` gets a
    gradient other than the sum of theirs, ``refuse()`` (which raises, or returns to let the
    backward go on where it is not captured)."""
    node, slot = kept.grad_fn, kept.output_nr
    shares = _Shares()
    for reader in inside:
        edges = [
            i for i, (nxt, nr) in enumerate(reader.next_functions) if nxt is node and nr == slot
        ]
        if edges:
            reader.register_hook(_sender(shares, edges))

    def check(grad: Tensor) -> None:
        sent = shares.take()
        total = sent[0] if sent else torch.zeros_like(grad)
        for g in sent[1:]:
            total = total + g
        if total is not grad and not (total.shape == grad.shape and torch.equal(total, grad)):
            refuse()

    kept.register_hook(check)


def _sender(shares: _Shares, edges: list[int]) -> Callable:
    def sent(grad_inputs: tuple, grad_outputs: tuple) -> None:
        for i in edges:
            shares.add(grad_inputs[i])

    return sent

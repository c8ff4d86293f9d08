"""Fuzzing: random small models from the supported layers against the oracles, in float64.

Each model (tests/fuzz_models.py: random layers, shapes and hyper-parameters, reuse, tying,
frozen and bare parameters, custom layers through the fallback) is checked for

- ``grad1`` == ``vmap(grad)`` == the per-example loop, and ``grad1`` reduced == ``.grad``;
- ``h.param_norms()``, ``h.norms()``, ``h.sum_grad_sq()``, ``h.grad_variance()`` == the same
  quantities of the loop's per-example gradients,

under a mean or a sum loss. ``GRADHOOKS_FUZZ_EXAMPLES`` sets how many models (default 200: one
to three minutes on two shared cores). Fewer draws drop layers from the mix: 100 check no Conv1d,
LSTM or ConvTranspose2d, which 200 draw once, twice and four times;
``GRADHOOKS_FUZZ_RANDOM=1`` draws new ones on every run (by default the same, derandomized).
The test prints how many models it tried and the layer mix (``pytest -s`` or ``-rA``).
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from fuzz_models import FuzzCase, fuzz_cases, fuzz_settings
from hypothesis import given

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, sum_of_squares

EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_EXAMPLES", "200"))
TRIED: Counter = Counter()  # models checked, and the layer mix, over the run


def loss_of(out, batch: int, reduction: str):
    loss = sum_of_squares(out)  # the sum of per-example losses
    return loss / batch if reduction == "mean" else loss


def check_case(case: FuzzCase) -> None:
    model, x, reduction = case.model, case.inputs, case.reduction
    batch = x.shape[0]
    want = vmap_grad(model, sum_of_squares, x)
    loop = loop_grad(model, sum_of_squares, x)
    trainable = dict(model.named_parameters())
    assert set(want) == {n for n, p in trainable.items() if p.requires_grad}
    for name in loop:
        assert_close(loop[name], want[name], f"loop vs vmap, {name}")

    quantities = ("norms", "sum_grad_sq")
    together = ("grad1", *quantities) if case.quantities_together else ("grad1",)
    with gradhooks.add_hooks(model, reduction, quantities=together) as h:
        loss_of(model(x), batch, reduction).backward()
    for name, p in trainable.items():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"frozen {name} got a grad1"
            continue
        assert hasattr(p, "grad1"), f"{name} has no grad1"
        assert_close(p.grad1, want[name], f"grad1 ({reduction}, batch {batch}): {name}")
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        assert_close(reduced, p.grad, f"grad1 reduced vs .grad, {name}")
    if not case.quantities_together:
        gradhooks.clear_grad1(model)
        model.zero_grad(set_to_none=True)
        with gradhooks.add_hooks(model, reduction, quantities=quantities) as h:
            loss_of(model(x), batch, reduction).backward()
        for name, p in model.named_parameters():
            assert not hasattr(p, "grad1"), f"grad1 was formed for {name} (norms only)"

    param_norms, sums, variances = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    assert set(param_norms) == set(loop), f"norms of {sorted(param_norms)} != {sorted(loop)}"
    assert set(sums) == set(loop), f"sum_grad_sq of {sorted(sums)} != {sorted(loop)}"
    for name, g in loop.items():
        assert_close(param_norms[name], g.flatten(1).norm(dim=1), f"param_norms: {name}")
        assert_close(sums[name], (g**2).sum(0), f"sum_grad_sq: {name}")
        assert_close(variances[name], g.var(0, unbiased=False), f"grad_variance: {name}")
    total = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    assert_close(h.norms(), total, "norms (whole model)")


@fuzz_settings(EXAMPLES)
@given(fuzz_cases())
def fuzz(case: FuzzCase) -> None:
    check_case(case)
    TRIED["models"] += 1
    TRIED.update(case.mix)


def test_random_models_match_the_oracles():
    before = TRIED["models"]
    fuzz()
    tried = TRIED["models"] - before
    mix = ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items()) if k != "models")
    print(f"\nfuzz: {tried} random models checked against the oracles; layer mix: {mix}")
    assert tried >= min(EXAMPLES, 10), f"only {tried} models were tried"

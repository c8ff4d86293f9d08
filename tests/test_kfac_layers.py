"""K-FAC factors of layers whose pieces are not a plain ``[batch, shared, features]`` input and
output-gradient: the experts of a mixture (rows routed per token, padded per example), and
layers whose per-example gradient is written in another orientation than ``[out, in]``. Each
is compared, in float64, with the factors' definition computed by hand: the inputs and
output-gradients each example's positions give the layer, one example's own loss at a time."""

from __future__ import annotations

import pytest
import torch
from test_moe import MoE

import gradhooks

D = torch.float64


def routed_definition(model: MoE, x: torch.Tensor, expand: bool, reduction: str) -> dict:
    """{weight name: (A, G)} of every expert Linear by the definition, one example at a time:
    the example's tokens routed to the expert (its rows of the expert's input) and the gradient
    of the example's own loss (``sum of squares``) with respect to the expert's output there.
    ``A`` is bias-augmented and divided by the positions the expert saw (expand) or by the
    examples that sent it any (reduce: each its rows' mean input); ``G`` sums (or, reduced,
    sums each example's rows first) and is divided by the batch for ``"mean"``."""
    layers = {
        f"experts.{e}.{part}.weight": getattr(expert, part)
        for e, expert in enumerate(model.experts)
        for part in ("up", "down")
    }
    a_terms = {n: [] for n in layers}
    g_terms = {n: [] for n in layers}
    for b in range(x.shape[0]):
        seen = []
        handles = [
            m.register_forward_hook(
                lambda m, args, out, n=n, seen=seen: seen.append((n, args[0], out))
            )
            for n, m in layers.items()
        ]
        with gradhooks.paused():
            out = model(x[b : b + 1])
        for h in handles:
            h.remove()
        grads = torch.autograd.grad(out.pow(2).sum(), [o for *_, o in seen], allow_unused=True)
        for (n, inp, _), g in zip(seen, grads):
            if inp.shape[0] == 0:
                continue  # (no token of this example was routed there)
            a = torch.cat([inp, torch.ones_like(inp[:, :1])], 1)  # [rows, in + 1]
            if not expand:
                a, g = a.mean(0, keepdim=True), g.sum(0, keepdim=True)
            a_terms[n].append(a)
            g_terms[n].append(g)
    want = {}
    for n in layers:
        a, g = torch.cat(a_terms[n]), torch.cat(g_terms[n])
        G = g.T @ g / (x.shape[0] if reduction == "mean" else 1)
        want[n] = (a.T @ a / a.shape[0], G)
    return want


@pytest.mark.parametrize("how", ["kfac", "hooks"])
@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("style", ["where", "mask", "select"])
def test_expert_factors_count_the_tokens_routed_to_them(style, reduction, expand, how):
    """Each example sends a different number of tokens to an expert (the engine pads them to
    the most of one example): the factors count only the tokens routed, not the padding."""
    torch.manual_seed(0)
    model = MoE(style=style).double()
    x = torch.randn(4, 6, 4, dtype=D)
    want = routed_definition(model, x, expand, reduction)
    if how == "kfac":
        got = gradhooks.kfac(
            model, x, fisher="empirical", loss=lambda out: out.pow(2).sum(),
            reduction=reduction, expand=expand,
        )  # fmt: skip
    else:
        with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("kfac",)) as h:
            h._collector.kfac.expand = expand
            model(x).pow(2).sum().backward()
            got = h.kfac_factors(reduction)
    counts = [[len(t) for t in _routed(model, x, e)] for e in range(len(model.experts))]
    assert any(len(set(c)) > 1 for c in counts), counts  # (uneven: padding was added)
    for n, (A, G) in want.items():
        torch.testing.assert_close(got[n].A, A, rtol=1e-10, atol=1e-12, msg=f"{n} A")
        torch.testing.assert_close(got[n].G, G, rtol=1e-10, atol=1e-12, msg=f"{n} G")


def _routed(model: MoE, x: torch.Tensor, expert: int) -> list[torch.Tensor]:
    """Each example's tokens routed to ``expert`` (top-1)."""
    with torch.no_grad():
        chosen = model.gate(x).argmax(-1)  # [batch, tokens]
    return [torch.where(c == expert)[0] for c in chosen]

"""K-FAC factors against their explicit definitions (a per-example loop capturing each layer's
input and output-gradient) and against the exact GGN where theory says K-FAC is exact."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from cases import CASES
from torch import nn

import gradhooks
from harness import _double, assert_close


def explicit_factors(model, case, inputs, target, expand: bool, reduction: str):
    """{weight name: (A, G)} by their definitions, one example at a time: a layer's input
    columns (Linear: the input; Conv: F.unfold of it) and the gradient of the example's own loss
    with respect to the layer's output, at every call."""
    layers = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)
    }
    acc: dict[str, list] = {}
    for b in range(inputs.shape[0]):
        seen = []
        handles = [
            m.register_forward_hook(lambda m, args, out, n=n: seen.append((n, m, args[0], out)))
            for n, m in layers.items()
        ]  # fmt: skip
        with gradhooks.paused():
            out = model(inputs[b : b + 1])
        for h in handles:
            h.remove()
        loss = case.loss(out) if target is None else case.loss(out, target[b : b + 1])
        grads = torch.autograd.grad(loss, [o for *_, o in seen])
        for (_, m, x, _), g in zip(seen, grads):
            name = next(pn for pn, p in model.named_parameters() if p is m.weight)
            if isinstance(m, nn.Linear):
                a, gg = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # [shared, in/out]
            else:
                assert m.groups == 1 and m.padding_mode == "zeros", (
                    "explicit conv: plain convs only"
                )
                nd = x.dim() - 2
                xx = x if nd == 2 else x.unsqueeze(-2)
                k = m.kernel_size if nd == 2 else (1, *m.kernel_size)
                unf = lambda t, kk: F.unfold(t, kk, dilation=m.dilation if nd == 2 else (1, *m.dilation),
                                             padding=m.padding if nd == 2 else (0, *m.padding),
                                             stride=m.stride if nd == 2 else (1, *m.stride))  # fmt: skip
                if nd == 3:
                    pytest.skip("explicit factors for Conv3d need an N-d unfold")
                a = unf(xx, k)[0].T  # [positions, in*kernel]
                gg = g.flatten(2)[0].T  # [positions, out]
            if m.bias is not None:
                a = torch.cat([a, torch.ones_like(a[:, :1])], 1)
            if not expand:
                a, gg = a.mean(0, keepdim=True), gg.sum(0, keepdim=True)
            acc.setdefault(name, []).append((a, gg))
    result = {}
    for name, pairs in acc.items():
        aa = sum(a.T @ a for a, _ in pairs) / sum(a.shape[0] for a, _ in pairs)
        gg = sum(g.T @ g for _, g in pairs)
        result[name] = (aa, gg / inputs.shape[0] if reduction == "mean" else gg)
    return result


def plain(case):
    """Cases whose layers with parameters are all ungrouped Linear / Conv1d / Conv2d, the
    layers explicit_factors knows how to unfold."""
    m = case.model()
    return all(
        isinstance(c, nn.Linear | nn.Conv1d | nn.Conv2d) and c.groups == 1
        if isinstance(c, nn.Conv1d | nn.Conv2d)
        else isinstance(c, nn.Linear) or not list(c.parameters(recurse=False))
        for c in m.modules()
    )


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", [c for c in CASES if plain(c)], ids=repr)
def test_factors_equal_their_definitions(case, reduction, expand):
    torch.manual_seed(0)
    model = case.model().double()
    inputs, target = _double(case.inputs(4)), case.target(4) if case.target else None
    want = explicit_factors(model, case, inputs, target, expand, reduction)
    with gradhooks.add_hooks(model, reduction, quantities=("kfac",)) as h:
        h._collector.kfac.expand = expand
        out = model(inputs)
        loss = case.loss(out) if target is None else case.loss(out, target)
        (loss / 4 if reduction == "mean" else loss).backward()
    got = h.kfac_factors(reduction)
    assert set(got) == set(want), f"{case.id}: {sorted(got)} != {sorted(want)}"
    for name, (A, G) in want.items():
        assert_close(got[name].A, A, f"{case.id}: A of {name}")
        assert_close(got[name].G, G, f"{case.id}: G of {name}")


def per_example_ggn(model, x, loss_hessian):
    """[batch, P, P] exact GGN blocks Jᵀ H J of every parameter, from torch.func.jacrev."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(sample):
        f = lambda p: torch.func.functional_call(model, p, (sample[None],))[0]
        return torch.func.jacrev(f)(params)

    with gradhooks.paused():
        jac = torch.vmap(one)(x)  # {name: [batch, C, *shape]}
    return {
        n: torch.einsum("bcp,cd,bdq->bpq", j.flatten(2), loss_hessian, j.flatten(2))
        for n, j in jac.items()
    }


def test_kfac_is_the_exact_ggn_for_a_deep_linear_network_with_mse():
    """Deep linear network, MSE: the backward Jacobian does not depend on the example, so
    G ⊗ A (bias-augmented) is the GGN block exactly, for any batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(3, 2)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    factors = gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum")
    hess = 2 * torch.eye(2, dtype=torch.float64)  # F.mse_loss(reduction="sum")
    params = dict(model.named_parameters())
    # the GGN of theta = cat([W, b[:, None]], 1) for every layer, from Jacobians of theta
    for name, f in factors.items():
        prefix = name.rsplit(".", 1)[0]
        W, b = params[f"{prefix}.weight"], params[f"{prefix}.bias"]

        def fn(theta, sample):
            p = {f"{prefix}.weight": theta[:, :-1], f"{prefix}.bias": theta[:, -1]}
            with gradhooks.paused():
                return torch.func.functional_call(model, p, (sample[None],), strict=False)[0]

        theta = torch.cat([W, b[:, None]], 1).detach()
        J = torch.vmap(torch.func.jacrev(fn), in_dims=(None, 0))(theta, x).flatten(2)  # [b, C, P]
        ggn = torch.einsum("bcp,cd,bdq->pq", J, hess, J)
        assert f.bias and f.A.shape[-1] == W.shape[1] + 1
        assert_close(torch.kron(f.G, f.A), ggn, f"K-FAC vs GGN, {name}")


def test_kfac_is_the_exact_ggn_for_one_example_of_any_network():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    factors = gradhooks.kfac(
        model, x, fisher="exact", loss="cross_entropy", reduction="sum", bias=False
    )
    with gradhooks.paused():
        p = torch.softmax(model(x), -1)[0]
    ggn = per_example_ggn(model, x, torch.diag(p) - torch.outer(p, p))
    for name, f in factors.items():
        assert_close(torch.kron(f.G, f.A), ggn[name][0], f"K-FAC vs GGN, one example, {name}")


def test_empirical_factors_of_one_example_are_its_gradient_outer_product():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()
    x, y = torch.randn(1, 2, 4, 4, dtype=torch.float64), torch.randint(3, (1,))
    factors = gradhooks.kfac(model, x, y, fisher="empirical", reduction="sum", bias=False)
    with gradhooks.add_hooks(model, "sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()
    g = model[3].weight.grad1[0].flatten()  # shared == 1: exact
    assert_close(
        torch.kron(factors["3.weight"].G, factors["3.weight"].A), torch.outer(g, g), "linear"
    )


def test_mc_fisher_is_reproducible_and_converges_to_the_exact_one():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    exact = gradhooks.kfac(model, x, fisher="exact")
    run = lambda n, s: gradhooks.kfac(
        model, x, fisher="mc", mc_samples=n, generator=torch.Generator().manual_seed(s)
    )
    a, b = run(2, 5), run(2, 5)
    for name in exact:
        assert torch.equal(a[name].G, b[name].G), "same generator, different samples"
        assert_close(a[name].A, exact[name].A, f"A does not depend on the backward, {name}")
    # many samples in one backward: the batch repeated (mean factors do not change)
    many = gradhooks.kfac(
        model, x.repeat(2000, 1), fisher="mc", generator=torch.Generator().manual_seed(0)
    )
    for name in exact:
        err = (many[name].G - exact[name].G).norm() / exact[name].G.norm()
        assert err < 0.1, f"MC Fisher G far from the exact one for {name}: relative error {err:.3f}"


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented"])
@pytest.mark.parametrize(
    "layout",
    ["rows", "few-shared", "per-example", "one-by-one", "groups", "empty"],
)
def test_second_moment_every_form(layout, augment, monkeypatch):
    """``second_moment`` (the factors' products) against its definition, ``alpha · Σ_{b,s}
    t tᵀ`` with a column of ones appended, in each of its forms, first alone then added to
    what is there (a reused module's second call)."""
    from gradhooks.quantities.kfac import second_moment

    torch.manual_seed(4)
    batch = 0 if layout == "empty" else 3
    if layout == "one-by-one":
        monkeypatch.setattr(gradhooks.TUNING, "kfac_products_at_once", 1)
    if layout in ("rows", "empty"):  # a Linear over positions: n contiguous
        t = torch.randn(batch, 5, 4, dtype=torch.float64)
    elif layout == "few-shared":  # positions contiguous, fewer than n / 4
        t = torch.randn(batch, 9, 2, dtype=torch.float64).transpose(1, 2)
    elif layout == "groups":
        t = torch.randn(batch, 3, 6, 4, dtype=torch.float64)
    else:  # a convolution's columns: [batch, groups = 1, positions, n], positions contiguous
        t = torch.randn(batch, 1, 4, 7, dtype=torch.float64).transpose(2, 3)
    ones = torch.ones(*t.shape[:-1], 1, dtype=t.dtype)
    full = torch.cat([t, ones], -1) if augment else t
    want = torch.einsum("b...si,b...sj->...ij", full, full)
    first = second_moment(t, augment=augment, alpha=0.5)
    assert_close(first, 0.5 * want, f"{layout}: alone")
    both = second_moment(t, augment=augment, into=first.clone(), alpha=2.0)
    assert_close(both, 2.5 * want, f"{layout}: added to the sum so far")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_factors_handed_out_do_not_change_with_the_next_backward(reduction):
    """The sums grow in place with every backward; the factors already handed out stay."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(2, (6,))
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        first = h.kfac_factors(reduction)
        kept = {n: (f.A.clone(), f.G.clone()) for n, f in first.items()}
        F.cross_entropy(model(x), y, reduction="sum").backward()
        second = h.kfac_factors(reduction)
    for name, (A, G) in kept.items():
        assert torch.equal(first[name].A, A) and torch.equal(first[name].G, G), name
        if reduction == "sum":
            assert_close(second[name].G, 2 * G, f"{name}: G summed over both backwards")


@pytest.mark.parametrize("fisher", ["exact", "mc"])
def test_batched_backwards_in_chunks_or_one_by_one_agree(fisher, monkeypatch):
    """kfac()'s backwards (one per class, or per sample) under vmap all at once, in chunks of
    two, and one after another give the same factors."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 5)
    ).double()
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    per_column = 4 * (3 * 2 * 2 + 5 + 5)  # the hooked calls' output elements
    chunks = []
    vmap = torch.func.vmap
    monkeypatch.setattr(
        torch.func, "vmap", lambda f, chunk_size=None: chunks.append(chunk_size) or vmap(f, chunk_size=chunk_size)
    )  # fmt: skip
    results = {}
    for name, limit in [("all", 1 << 20), ("pairs", 2 * per_column), ("one", 1)]:
        monkeypatch.setattr(gradhooks.TUNING, "kfac_vmap_elements", limit)
        gen = torch.Generator().manual_seed(0)
        results[name] = gradhooks.kfac(model, x, fisher=fisher, mc_samples=5, generator=gen)
    assert chunks[:2] == [(1 << 20) // per_column, 2] and len(chunks) == 2, chunks
    for name in ("pairs", "one"):
        for key, f in results["all"].items():
            assert_close(results[name][key].A, f.A, f"{name}: A of {key}")
            assert_close(results[name][key].G, f.G, f"{name}: G of {key}")


class _SequenceModel(nn.Module):
    """Tokens ``[batch, seq]`` -> logits ``[batch, seq, 6]``; positions mix (a running sum), so
    a layer's output-gradient at one position comes from the losses at several."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.hidden = nn.Linear(4, 5)
        self.out = nn.Linear(5, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.embed(x))).cumsum(1))


def test_empirical_factors_of_a_sequence_output_are_those_of_its_summed_loss():
    torch.manual_seed(8)
    model = _SequenceModel().double()
    x, y = torch.randint(7, (3, 4)), torch.randint(6, (3, 4))
    got = gradhooks.kfac(model, x, y, fisher="empirical", reduction="sum")
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").backward()
        want = h.kfac_factors("sum")
    assert set(got) == set(want) == {"hidden.weight", "out.weight"}
    for name, w in want.items():
        assert_close(got[name].A, w.A, f"A of {name}")
        assert_close(got[name].G, w.G, f"G of {name}")


def test_mc_factors_of_a_sequence_output_converge_to_the_exact_ones_per_position():
    """One sampled label per position: unbiased for the Fisher, whose exact G takes one
    backward per class and position (the oracle below); kfac(fisher='exact') refuses such an
    output rather than add the terms between positions that one backward per class would."""
    torch.manual_seed(9)
    model = _SequenceModel().double()
    x = torch.randint(7, (3, 4))
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        out = model(x)
        p = torch.softmax(out.detach(), -1)
        eye = torch.eye(6, dtype=p.dtype)
        params = list(model.parameters())
        for t in range(4):
            for c in range(6):
                v = torch.zeros_like(out)
                v[:, t] = p[:, t, c : c + 1].sqrt() * (eye[c] - p[:, t])
                torch.autograd.grad(out, params, v, retain_graph=True)
        exact = h.kfac_factors("sum")
    many = gradhooks.kfac(
        model, x.repeat(3000, 1), fisher="mc", generator=torch.Generator().manual_seed(0)
    )
    for name, f in exact.items():
        assert_close(many[name].A, f.A, f"A of {name}")
        err = (many[name].G - f.G / 3).norm() / (f.G / 3).norm()
        assert err < 0.1, f"MC G far from the exact one for {name}: relative error {err:.3f}"
    with pytest.raises(ValueError, match=r"fisher='exact'.*\(3, 4, 6\).*fisher='mc'"):
        gradhooks.kfac(model, x, fisher="exact")


def test_a_weight_tied_to_an_embedding_gets_a_warning_naming_its_other_use():
    """The factors of a weight used both as an output Linear's and as an Embedding's cover the
    Linear use only: said, naming the weight and the other module; an untied model says
    nothing."""
    from gradhooks import GradhooksWarning

    class Tied(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            if tie:
                self.out.weight = self.embed.weight

        def forward(self, x):
            return self.out(torch.tanh(self.embed(x)))

    torch.manual_seed(10)
    x = torch.randint(7, (3, 5))
    with pytest.warns(GradhooksWarning, match=r"'embed\.weight'.*'embed' \(Rows\)"):
        factors = gradhooks.kfac(Tied(True).double(), x, fisher="mc")
    assert set(factors) == {"embed.weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(gradhooks.kfac(Tied(False).double(), x, fisher="mc")) == {"out.weight"}


def test_several_backwards_of_one_forward_sum_g_and_mean_averages_them():
    """Through the hooks, two backwards of one forward: ``G`` sums them ("sum"), and "mean"
    divides by the examples of both (their average); ``A`` is the input's either way."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        out = model(x)
        u, v = torch.randn_like(out), torch.randn_like(out)
        out.backward(u, retain_graph=True)
        one = {r: h.kfac_factors(r) for r in ("mean", "sum")}
        out.backward(v)
        both = {r: h.kfac_factors(r) for r in ("mean", "sum")}
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        model(x).backward(v)
        other = h.kfac_factors("sum")
    for name in one["sum"]:
        total = one["sum"][name].G + other[name].G
        assert_close(both["sum"][name].G, total, f"{name}: G summed over the backwards")
        assert_close(both["mean"][name].G, total / 10, f"{name}: G over 2 x 5 examples")
        assert_close(both["mean"][name].A, one["mean"][name].A, f"{name}: A")

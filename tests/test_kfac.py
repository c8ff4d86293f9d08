"""K-FAC factors against their explicit definitions (a per-example loop capturing each layer's
input and output-gradient) and against the exact GGN where theory says K-FAC is exact."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from cases import CASES
from torch import nn

import gradhooks
from harness import Logits, _double, assert_close, hf


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
    layers explicit_factors knows how to unfold (not a subclass with parameters of its own, as
    loralib's LoRA layers: their adapters have factors of their own)."""
    m = case.model()
    return all(
        isinstance(c, nn.Linear | nn.Conv1d | nn.Conv2d) and c.groups == 1
        if isinstance(c, nn.Conv1d | nn.Conv2d)
        else (isinstance(c, nn.Linear) and set(dict(c.named_parameters())) <= {"weight", "bias"})
        or not list(c.parameters(recurse=False))
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
        h._state.collector.kfac.expand = expand
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
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"fisher='exact'.*\(3, 4, 6\).*fisher='mc'"
    ):
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


def test_a_weight_whose_rule_gives_no_factors_is_named_where_factors_are_read():
    """A Bilinear (no rule: the fallback's dense per-example gradient) gets no Kronecker
    factors: left out of the factors, and said (the warning names the weight, its shape and
    its module), by :func:`gradhooks.kfac` and by ``Hooks.kfac_factors``; the accumulator
    lists it. The Linear beside it gets its factors; biases, an embedding's table, a norm's
    2-d scale and the model's own positional parameter are not listed (no factors by
    construction)."""
    from gradhooks import GradhooksWarning

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(7, 4), nn.LayerNorm((3, 4))
            self.pos = nn.Parameter(torch.randn(1, 3, 4))
            self.bil, self.fc = nn.Bilinear(4, 4, 5), nn.Linear(5, 3)

        def forward(self, t):
            x = self.norm(self.embed(t) + self.pos).mean(1)
            return self.fc(torch.tanh(self.bil(x, x)))

    torch.manual_seed(12)
    net, t = Net().double(), torch.randint(7, (6, 3))
    said = r"no Kronecker factors for 'bil\.weight' \(5, 4, 4\) \(module 'bil'"
    with pytest.warns(GradhooksWarning, match=said) as record:
        factors = gradhooks.kfac(net, t, fisher="mc")
    assert set(factors) == {"fc.weight"}
    assert all(k not in str(w.message) for w in record for k in ("embed", "norm", "pos"))
    with gradhooks.add_hooks(net, "sum", quantities=("kfac",)) as h:
        net(t).sum().backward()
        acc = gradhooks.engine.api.engine_of(h).results("kfac").kfac
        assert list(acc.unfactored) == ["bil.weight"]
        with pytest.warns(GradhooksWarning, match=said):
            assert set(h.kfac_factors()) == {"fc.weight"}


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


# -- real call signatures: several inputs, keyword inputs, tied heads, Hugging Face models --------


def hand_factors(model, args, kwargs, target, layers, expand=True, reduction="sum", bias=True):
    """{weight name: (A, G)} of the empirical Fisher (summed cross-entropy at ``target``) by
    their definitions, one example at a time: each chosen layer's input rows (bias column
    appended) and the gradient of the example's own loss with respect to its output, at every
    call. ``layers``: ``{weight name: module}``, modules computing ``x @ W.T + b`` or
    ``x @ W + b`` (a Linear; GPT-2's Conv1D) on ``[..., in]``."""
    batch = target.shape[0]
    per = lambda t: isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
    acc: dict[str, list] = {}
    for b in range(batch):
        seen = []
        handles = [
            m.register_forward_hook(lambda m, a, out, n=n: seen.append((n, m, a[0], out)))
            for n, m in layers.items()
        ]  # fmt: skip
        one = tuple(a[b : b + 1] if per(a) else a for a in args)
        kw = {k: v[b : b + 1] if per(v) else v for k, v in kwargs.items()}
        try:
            with gradhooks.paused():
                out = model(*one, **kw)
        finally:
            for h in handles:
                h.remove()
        loss = F.cross_entropy(out.flatten(0, -2), target[b : b + 1].flatten(), reduction="sum")
        grads = torch.autograd.grad(loss, [o for *_, o in seen])
        for (name, m, x, _), g in zip(seen, grads):
            a, gg = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
            if bias and getattr(m, "bias", None) is not None:
                a = torch.cat([a, torch.ones_like(a[:, :1])], 1)
            if not expand:
                a, gg = a.mean(0, keepdim=True), gg.sum(0, keepdim=True)
            acc.setdefault(name, []).append((a, gg))
    result = {}
    for name, pairs in acc.items():
        aa = sum(a.T @ a for a, _ in pairs) / sum(a.shape[0] for a, _ in pairs)
        gg = sum(g.T @ g for _, g in pairs)
        result[name] = (aa, gg / batch if reduction == "mean" else gg)
    return result


def assert_factors(got, want, what):
    assert set(got) == set(want), f"{what}: {sorted(got)} != {sorted(want)}"
    for name, (A, G) in want.items():
        assert_close(got[name].A, A, f"{what}: A of {name}")
        assert_close(got[name].G, G, f"{what}: G of {name}")


class TwoInputs(nn.Module):
    """``model(x, y, scale=..., mask=...)``: x ``[batch, positions, 4]``, y ``[batch, 2]``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(2, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x, y, scale=1.0, mask=None):
        h = torch.tanh(self.a(x))
        h = h if mask is None else h * mask[..., None]
        return self.head(scale * h.mean(1) + self.b(y))


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_several_inputs_and_keyword_arguments(reduction, expand):
    torch.manual_seed(12)
    model = TwoInputs().double()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 6, 4, dtype=torch.float64, generator=g)
    y = torch.randn(4, 2, dtype=torch.float64, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    target = torch.randint(3, (4,), generator=g)
    kwargs = {"scale": 2.0, "mask": mask}
    layers = {f"{n}.weight": getattr(model, n) for n in ("a", "b", "head")}
    want = hand_factors(model, (x, y), kwargs, target, layers, expand, reduction)
    got = gradhooks.kfac(
        model, (x, y), target, kwargs=kwargs, fisher="empirical", reduction=reduction,
        expand=expand,
    )  # fmt: skip
    assert_factors(got, want, "model(x, y, scale=, mask=)")


class TiedHead(nn.Module):
    """``logits = F.linear(h, self.emb.weight)`` (GPT-2-style tying, functional form)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, tokens):
        return F.linear(torch.tanh(self.mix(self.emb(tokens))).mean(1), self.emb.weight)


def test_a_tied_head_in_the_functional_form_gets_the_factors_of_its_linear_use():
    """The head's input and output-gradient give ``emb.weight`` its factors (the Embedding's
    use has no Kronecker form: said), equal to those of the same model with an untied
    ``nn.Linear`` head holding a copy of the weight (checked by hand)."""
    from gradhooks import GradhooksWarning

    torch.manual_seed(13)
    tied = TiedHead().double()

    class Untied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mix = copy.deepcopy(tied.emb), copy.deepcopy(tied.mix)
            self.head = nn.Linear(4, 7, bias=False).double()
            with torch.no_grad():
                self.head.weight.copy_(tied.emb.weight)

        def forward(self, tokens):
            return self.head(torch.tanh(self.mix(self.emb(tokens))).mean(1))

    untied = Untied()
    tokens = torch.randint(7, (5, 3), generator=torch.Generator().manual_seed(13))
    target = torch.randint(7, (5,), generator=torch.Generator().manual_seed(14))
    layers = {"mix.weight": untied.mix, "head.weight": untied.head}
    want = hand_factors(untied, (tokens,), {}, target, layers, reduction="mean")
    want["emb.weight"] = want.pop("head.weight")
    with pytest.warns(GradhooksWarning, match=r"'emb\.weight'.*'emb' \(Rows\)"):
        got = gradhooks.kfac(tied, tokens, target, fisher="empirical")
    assert_factors(got, want, "tied head")
    assert got["emb.weight"].bias is False


@pytest.mark.parametrize(
    "how, says",
    [
        ("scalar", r"output \(\) for a batch of 3 .* scalar"),
        ("sum0", r"output \(\(3,\)\) mixes the 3 examples"),
        ("transposed", r"output \(3, 3\) .* examples are on dimension 1"),
        ("dict", r"returned a dict, not a tensor"),
    ],
)
def test_an_output_without_the_batch_is_refused(how, says):
    class Reduced(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            out = self.fc(x)
            return {"scalar": lambda: out.sum(), "sum0": lambda: out.sum(0),
                    "transposed": lambda: out.T, "dict": lambda: {"logits": out}}[how]()  # fmt: skip

    model = Reduced().double()
    with pytest.raises((ValueError, RuntimeError, TypeError), match=says):
        gradhooks.kfac(model, torch.randn(3, 4, dtype=torch.float64), fisher="mc")
    with pytest.raises(ValueError, match="no gradhooks hooks"):
        gradhooks.hooks_of(model)  # (nothing left on the model)


def test_bfloat16_autocast_on_linear_layers():
    """Under CPU autocast to bfloat16 the Linears compute in bfloat16 (8 significant bits):
    ``A`` and ``G`` are within 3% of the largest entry of the float64 factors of the same
    weights (sums of products of bfloat16-rounded inputs and output-gradients, each about
    0.4% off)."""
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(3, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradhooks.kfac(model, x, y, fisher="empirical")
    model = model.double()
    layers = {"0.weight": model[0], "2.weight": model[2]}
    want = hand_factors(model, (x.double(),), {}, y, layers, reduction="mean")
    for name, (A, G) in want.items():
        for what, g, w in (("A", got[name].A, A), ("G", got[name].G, G)):
            scale = w.abs().max().item()
            torch.testing.assert_close(
                g.double(), w, rtol=0, atol=3e-2 * scale, msg=lambda m: f"{what} of {name}: {m}"
            )


def test_bfloat16_autocast_exact_fisher_over_positions():
    """``fisher="exact"`` (one backward per class, batched) under CPU autocast to bfloat16 on
    Linears over positions and a LayerNorm (whose vmapped backward torch cannot run in mixed
    dtypes: the backwards then run one at a time): within 3% of the largest entry of the
    float64 factors of the same weights (bfloat16's 8 significant bits, as above)."""

    class OverPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 8)
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.norm(torch.tanh(self.fc(x)))).mean(1)

    torch.manual_seed(20)
    model, x = OverPositions(), torch.randn(6, 5, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradhooks.kfac(model, x, fisher="exact")
    want = gradhooks.kfac(model.double(), x.double(), fisher="exact")
    assert set(got) == set(want) == {"fc.weight", "head.weight"}
    for name, w in want.items():
        for what, g, ww in (("A", got[name].A, w.A), ("G", got[name].G, w.G)):
            assert g.dtype == torch.float32, f"{what} of {name}: {g.dtype}"
            torch.testing.assert_close(
                g.double(), ww, rtol=0, atol=3e-2 * ww.abs().max().item(),
                msg=lambda m, name=name, what=what: f"{what} of {name}: {m}",
            )  # fmt: skip


def padded_batch(vocab):
    g = torch.Generator().manual_seed(16)
    ids = torch.randint(vocab, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask, torch.randint(vocab, (3,), generator=g)


def test_bert_classifier_with_padding_mask():
    """Every Linear of a tiny BERT (attention, feed-forward, pooler, classifier) with a
    right-padded ``attention_mask=`` keyword input, against the hand computation."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=12, vocab_size=12, max_position_embeddings=8,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  num_labels=3)  # fmt: skip
    torch.manual_seed(17)
    model = Logits(hf("BertForSequenceClassification")(cfg), last=False).double().eval()
    ids, mask, _ = padded_batch(12)
    mask = mask.flip(1)
    target = torch.randint(3, (3,), generator=torch.Generator().manual_seed(18))
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = hand_factors(model, (ids,), {"attention_mask": mask}, target, layers)
    got = gradhooks.kfac(
        model, ids, target, kwargs={"attention_mask": mask}, fisher="empirical", reduction="sum"
    )
    assert_factors(got, want, "BERT")


def test_gpt2_with_padding_mask():
    """A tiny GPT-2: its Conv1D layers (``torch.addmm(b, x, W)``, ``W`` ``[in, out]``) get factors
    from their input and output-gradient, its lm_head those of its use as a Linear (tied to the
    token embeddings: said), with a left-padded ``attention_mask=``, against the hand
    computation."""
    from gradhooks import GradhooksWarning

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=12, n_positions=8,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    torch.manual_seed(19)
    model = Logits(hf("GPT2LMHeadModel")(cfg)).double().eval()
    ids, mask, target = padded_batch(12)
    conv1d = type(model.model.transformer.h[0].attn.c_attn)
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, conv1d)}
    layers["model.transformer.wte.weight"] = model.model.lm_head
    want = hand_factors(model, (ids,), {"attention_mask": mask}, target, layers, bias=False)
    for name in layers:
        if name != "model.transformer.wte.weight":  # W [in, out]: its rows are the inputs
            A, G = want[name]
            # the weight as a matrix [in, out]: G over its rows (inputs, summed), A over its
            # columns (output-gradients, averaged over the 3 x 5 positions)
            rows = 3 * 5
            want[name] = (G / rows, A * rows)
    with pytest.warns(GradhooksWarning, match=r"wte\.weight"):
        got = gradhooks.kfac(
            model, ids, target, kwargs={"attention_mask": mask}, fisher="empirical",
            reduction="sum",
        )  # fmt: skip
    assert_factors(got, want, "GPT-2")

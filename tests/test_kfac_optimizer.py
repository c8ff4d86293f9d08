"""The K-FAC optimizer: its factors against curvlinops' KFAC operator, its running averages and
intervals against the factors of each step, its update against a dense damped solve, its
adaptive damping, its failures, checkpoints, and real models (a CNN, a transformer)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.models import TinyGPT

D = torch.float64


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(D)


def _batch(seed: int, n: int = 12, features: int = 5, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, dtype=D, generator=g), torch.randint(classes, (n,), generator=g)


class _Tokens(nn.Module):
    """A Linear shared over 4 positions (weight sharing), then a conv: the two layer families
    curvlinops covers, with the output [batch, classes]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.proj = nn.Linear(3, 4)
        self.head = nn.Linear(4 * 16, 3)

    def forward(self, x):
        h = self.conv(x).flatten(2).transpose(1, 2)  # [batch, 16 positions, 3]
        return self.head(torch.tanh(self.proj(h)).flatten(1))


# -- the factors against a kept library ----------------------------------------------------------


@pytest.mark.parametrize("fisher,theirs", [("exact", "type-2"), ("empirical", "empirical")])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_match_curvlinops_kfac_operator(fisher, theirs, approx):
    # (not in the test extra: it needs backpack-for-pytorch, which pulls a torchvision built
    # for CUDA, whose import breaks transformers' on a CPU-only torch)
    curvlinops = pytest.importorskip("curvlinops", reason="pip install curvlinops-for-pytorch")
    torch.manual_seed(0)
    model = _Tokens().to(D)
    x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(3, (6,))
    params = list(model.parameters())
    op = curvlinops.KFACLinearOperator(
        model, nn.CrossEntropyLoss(), params, [(x, y)], fisher_type=theirs,
        kfac_approx=approx, separate_weight_and_bias=False, check_deterministic=False,
    )  # fmt: skip
    ours = gradhooks.kfac(model, x, y, fisher=fisher, expand=approx == "expand")
    v = [torch.randn_like(p) for p in params]
    expected = dict(zip([n for n, _ in model.named_parameters()], op @ v, strict=True))
    vs = dict(zip([n for n, _ in model.named_parameters()], v, strict=True))
    for weight, f in ours.items():
        module = weight.rsplit(".", 1)[0]
        w, b = vs[weight], vs[f"{module}.bias"]
        matrix = torch.cat([w.flatten(1), b[:, None]], 1)
        product = f.G @ matrix @ f.A  # kron(G, A) vec(matrix), row-major
        torch.testing.assert_close(product[:, :-1].reshape(w.shape), expected[weight])
        torch.testing.assert_close(product[:, -1], expected[f"{module}.bias"])


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_match_asdl(approx):
    """ASDL (asdfghjkl) computes the GGN's Kronecker factors of Linear and Conv2d layers, the
    bias kept apart (so ``bias=False`` here); its convolution factors are KFC's: ``expand``."""
    asdl = pytest.importorskip("asdl", reason="pip install asdfghjkl")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).to(D)  # fmt: skip
    x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(3, (6,))
    config = asdl.FisherConfig(
        fisher_type=asdl.FISHER_EXACT, fisher_shapes=[asdl.SHAPE_KRON],
        loss_type=asdl.LOSS_CROSS_ENTROPY, data_size=x.shape[0],
    )  # fmt: skip
    with warnings.catch_warnings():  # (its hooks are torch's deprecated non-full ones)
        warnings.simplefilter("ignore", FutureWarning)
        maker = asdl.get_fisher_maker(model, config)
        maker.setup_model_call(model, x)
        maker.setup_loss_call(F.cross_entropy, y)
        maker.forward_and_backward()
    ours = gradhooks.kfac(model, x, y, fisher="exact", bias=False, expand=approx == "expand")
    for name, module in [("0.weight", model[0]), ("3.weight", model[3])]:
        theirs = module.fisher.kron
        if approx == "reduce" and name == "0.weight":  # the convolution: ASDL's is KFC's
            assert not torch.allclose(ours[name].A, theirs.A)
            continue
        torch.testing.assert_close(ours[name].A, theirs.A)
        torch.testing.assert_close(ours[name].G, theirs.B)


# -- running averages, intervals, the update ------------------------------------------------------


def _train(model, opt, batches, **step_args):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(x, y, **step_args)


def test_running_factors_are_the_decayed_average_of_each_steps_factors():
    model, decay = _mlp(), 0.8
    reference = copy.deepcopy(model)
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.1), fisher="empirical", decay=decay
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected: dict = {}
    for seed in range(3):
        x, y = _batch(seed)
        new = gradhooks.kfac(reference, x, y, fisher="empirical")  # at this step's parameters
        for name, f in new.items():
            if name in expected:
                a, g = expected[name]
                expected[name] = (decay * a + (1 - decay) * f.A, decay * g + (1 - decay) * f.G)
            else:
                expected[name] = (f.A, f.G)
        _train(model, opt, [(x, y)])
        # the reference steps with the same preconditioned update
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        inverses = {
            n: gradhooks.KFactors(a, g, True, n.replace("weight", "bias")).inverse(opt.damping)
            for n, (a, g) in expected.items()
        }
        gradhooks.kfac_precondition(reference, inverses)
        ref_opt.step()
        for name, (a, g) in expected.items():
            torch.testing.assert_close(opt.factors[name].A, a)
            torch.testing.assert_close(opt.factors[name].G, g)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


class _Pooled(nn.Module):
    """Tokens ``[batch, seq, 5]`` through a Linear, averaged over the positions an
    ``attention_mask`` keeps (a keyword input, as a Hugging Face model's), then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x, *, attention_mask):
        keep = attention_mask[..., None].to(x.dtype)
        h = (torch.tanh(self.proj(x)) * keep).sum(1) / keep.sum(1)
        return self.head(h)


def test_a_model_taking_keyword_inputs_steps_with_them():
    """``step(x, y, kwargs={"attention_mask": m})``: the factors are :func:`gradhooks.kfac`'s
    with the same keyword inputs, at the parameters before the step (the mask reached the
    forward: its ``G`` differs from the one without it), and the model moves by the update
    they precondition."""
    model = _Pooled().to(D)
    reference = copy.deepcopy(model)
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.5), fisher="empirical", decay=0.0
    )
    x, y = _batch(0, features=20)
    x = x.view(12, 4, 5)
    mask = torch.ones(12, 4, dtype=torch.long)
    mask[::2, 2:] = 0
    want = gradhooks.kfac(reference, x, y, kwargs={"attention_mask": mask}, fisher="empirical")
    unmasked = gradhooks.kfac(
        reference, x, y, kwargs={"attention_mask": torch.ones_like(mask)}, fisher="empirical"
    )
    opt.zero_grad()
    F.cross_entropy(model(x, attention_mask=mask), y).backward()
    opt.step(x, y, kwargs={"attention_mask": mask})
    F.cross_entropy(reference(x, attention_mask=mask), y).backward()
    inverses = {n: f.inverse(opt.damping) for n, f in want.items()}
    gradhooks.kfac_precondition(reference, inverses)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, f in want.items():
        torch.testing.assert_close(opt.factors[name].A, f.A, msg=f"A of {name}")
        torch.testing.assert_close(opt.factors[name].G, f.G, msg=f"G of {name}")
    assert not torch.allclose(unmasked["proj.weight"].G, want["proj.weight"].G)
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n)


def test_the_update_is_the_dense_damped_solve():
    """One SGD step of lr 1: each layer's [W, b] moves by -(kron(G, A) + λI)⁻¹ vec(grad)."""
    model, damping = _mlp(), 0.05
    before = copy.deepcopy(model)
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=1.0), fisher="exact", damping=damping
    )
    x, y = _batch(0)
    _train(model, opt, [(x, y)])
    F.cross_entropy(before(x), y).backward()
    for name, f in opt.factors.items():
        layer = before.get_submodule(name.rsplit(".", 1)[0])
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
        dense = torch.kron(f.G, f.A) + damping * torch.eye(f.G.shape[0] * f.A.shape[0], dtype=D)
        step = torch.linalg.solve(dense, grad.flatten()).view_as(grad)
        moved = model.get_submodule(name.rsplit(".", 1)[0])
        torch.testing.assert_close(moved.weight, layer.weight - step[:, :-1])
        torch.testing.assert_close(moved.bias, layer.bias - step[:, -1])


def test_a_factor_whose_float32_eigendecomposition_fails_is_inverted_in_float64(monkeypatch):
    """LAPACK's float32 ``eigh`` fails to converge on some factors with many repeated
    eigenvalues (fewer examples than features), on some processors' kernels: the inverse is
    then taken from the float64 decomposition, in the factors' dtype, and is the dense damped
    solve's."""
    torch.manual_seed(0)
    a = torch.randn(6, 3)
    g = torch.randn(4, 2)
    f = gradhooks.KFactors(a @ a.T, g @ g.T, False, None)  # ranks 3 and 2: repeated zeros
    plain = torch.linalg.eigh
    tried = []

    def eigh(m, *args, **kwargs):
        tried.append(m.dtype)
        if m.dtype != torch.float64:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return plain(m, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    inverse = f.inverse(0.1)
    assert tried == [torch.float32, torch.float64] * 2
    assert inverse.Q_A.dtype == inverse.scale.dtype == torch.float32
    grad = torch.randn(4, 6)
    dense = torch.kron(f.G, f.A).double() + 0.1 * torch.eye(24, dtype=D)
    want = torch.linalg.solve(dense, grad.double().flatten()).view_as(grad)
    torch.testing.assert_close(inverse.apply(grad), want.float(), rtol=1e-4, atol=1e-5)


def test_factors_and_inverses_are_updated_at_their_intervals(monkeypatch):
    model = _mlp()
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.1), fisher="empirical",
        factors_every=2, inverse_every=3,
    )  # fmt: skip
    estimates, inversions = [], []
    kfac, invert = gradhooks.workflows.kfac_optimizer._accumulate, gradhooks.KFactors.inverse
    monkeypatch.setattr(
        gradhooks.workflows.kfac_optimizer,
        "_accumulate",
        lambda *a, **k: estimates.append(opt.steps) or kfac(*a, **k),
    )
    monkeypatch.setattr(
        gradhooks.KFactors, "inverse", lambda f, d: inversions.append(opt.steps) or invert(f, d)
    )
    _train(model, opt, [_batch(s) for s in range(7)])
    assert estimates == [0, 2, 4, 6]
    assert sorted(set(inversions)) == [0, 3, 6]  # (each step: one inversion per weight)


# -- damping ---------------------------------------------------------------------------------------


def test_adaptive_damping_falls_where_the_model_predicts_well_and_rises_where_not():
    x, y = _batch(0, n=64)
    closure_of = lambda m: lambda: F.cross_entropy(m(x), y)
    for lr, direction in [(0.05, "down"), (200.0, "up")]:
        model = _mlp()
        opt = gradhooks.KFAC(
            model, torch.optim.SGD(model.parameters(), lr=lr), damping=1e-2, adaptive=True,
            adapt_every=1, fisher="exact",
        )  # fmt: skip
        _train(model, opt, [(x, y)] * 3, closure=closure_of(model))
        if direction == "down":
            assert 0.5 < opt.last_ratio < 2 and opt.damping < 1e-2, (opt.last_ratio, opt.damping)
        else:
            assert opt.last_ratio < 0.25 and opt.damping > 1e-2, (opt.last_ratio, opt.damping)


def test_adaptive_damping_without_a_closure_is_refused():
    model = _mlp()
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), adaptive=True)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(gradhooks.ConfigurationError):
        opt.step(x)


# -- failures name the parameter -------------------------------------------------------------------


def test_a_diverged_step_names_the_parameter():
    model = _mlp()
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(0)
    x[3, 2] = float("nan")
    F.cross_entropy(model(x), y).backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(gradhooks.NumericalError, match=r"'0\.weight'.*NaN or inf"):
        opt.step(x)
    for name, t in model.state_dict().items():  # no step taken
        assert torch.equal(t, before[name]), name


def test_factors_that_diverged_name_the_parameter():
    model = _mlp()
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), fisher="empirical")
    _train(model, opt, [_batch(0)])
    opt.factors["2.weight"].G[0, 0] = float("inf")  # as a blown-up output-gradient leaves it
    x, y = _batch(1)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(gradhooks.NumericalError, match=r"running factor G of '2\.weight'"):
        opt.step(x, y)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(damping=0.0), "damping"),
        (dict(decay=1.0), "decay"),
        (dict(inverse_every=0), "inverse_every"),
        (dict(damping=1e-3, damping_range=(1e-2, 1.0)), "damping_range"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    model = _mlp()
    with pytest.raises(gradhooks.ConfigurationError, match=match):
        gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    with pytest.raises(gradhooks.ConfigurationTypeError):
        gradhooks.KFAC(model, model.parameters())


# -- checkpoints, buffers, real models -------------------------------------------------------------


def test_resuming_from_a_checkpoint_continues_the_same_run():
    batches = [_batch(s) for s in range(6)]
    model = _mlp()
    opt = gradhooks.KFAC(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fisher="empirical")
    _train(model, opt, batches[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, batches[3:])
    resumed = _mlp(seed=1)
    resumed.load_state_dict(saved[0])
    opt2 = gradhooks.KFAC(
        resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-2), fisher="empirical"
    )
    opt2.load_state_dict(saved[1])
    _train(resumed, opt2, batches[3:])
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q)


class _Tracked(nn.Module):
    """Keeps a running mean of its input in a buffer in training, as a normalization layer's
    statistics do, without coupling the examples (its output is its input)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean(0), 0.1)
                self.calls += 1
        return x


def test_buffers_move_once_per_step_as_without_kfac():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), _Tracked(6), nn.Tanh(), nn.Linear(6, 3))
    plain = copy.deepcopy(model)
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.0))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.0)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randint(3, (8,))
        _train(model, opt, [(x, y)])
        plain_opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()
    assert int(model[1].calls) == 3
    for (name, b), c in zip(model.named_buffers(), plain.buffers(), strict=True):
        assert torch.equal(b, c), name


@pytest.mark.parametrize("base", ["SGD", "AdamW"])
@pytest.mark.parametrize("which", ["cnn", "transformer"])
def test_trains_real_models(which, base):
    torch.manual_seed(0)
    if which == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 6, 3), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 5 * 5, 10),
        )  # fmt: skip
        x, y = torch.randn(32, 1, 14, 14), torch.randint(10, (32,))
        loss_of = lambda out: F.cross_entropy(out, y)
    else:
        model = TinyGPT(vocab=32, dim=16, heads=2, layers=1, max_seq=8)
        x = torch.randint(32, (8, 8))
        y = x.roll(-1, 1)
        loss_of = lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())
    lr = 0.05 if base == "SGD" else 3e-3
    opt = gradhooks.KFAC(model, getattr(torch.optim, base)(model.parameters(), lr=lr), damping=0.1)
    losses = []
    # the tied embedding's factors are of its use as the output layer's weight: said
    tied = pytest.warns(gradhooks.GradhooksWarning, match="'tok.weight' cover only")
    with tied if which == "transformer" else contextlib.nullcontext():
        for _ in range(8):
            opt.zero_grad()
            loss = loss_of(model(x))
            loss.backward()
            opt.step(x)
            losses.append(loss.item())
    assert opt.factors, "no weight got factors"
    assert losses[-1] < losses[0], losses


# -- weights without factors -------------------------------------------------------------------


class _Bilinear(nn.Module):
    """A Bilinear layer (no rule: the fallback's per-example gradient, no Kronecker factors)."""

    def __init__(self):
        super().__init__()
        self.b, self.fc = nn.Bilinear(4, 4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.b(x, x)))


def test_a_weight_without_factors_is_refused_by_the_optimizer_unless_kept():
    torch.manual_seed(0)
    model, x, y = _Bilinear(), torch.randn(16, 4), torch.randint(3, (16,))
    before = copy.deepcopy(model.state_dict())
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(gradhooks.UnsupportedError, match=r"'b\.weight' \(5, 4, 4\).*'b'.*keep"):
        opt.step(x)
    for name, t in model.state_dict().items():  # nothing stepped
        torch.testing.assert_close(t, before[name], rtol=0, atol=0)
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), unfactored="keep")
    with pytest.warns(gradhooks.GradhooksWarning, match=r"no Kronecker factors for 'b\.weight'"):
        opt.step(x)
    assert set(opt.factors) == {"fc.weight"}
    with pytest.raises(gradhooks.ConfigurationError, match="unfactored"):
        gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), unfactored="skip")

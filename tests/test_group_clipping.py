"""Group-wise (per-layer) clipping for DP-SGD, against a float64 per-example loop: each
example's gradient (``loop_grad``) split by group, each group clipped to its own bound
(``min(1, C_k/‖g_ik‖)`` or ``C_k/(‖g_ik‖ + 0.01)``), summed, plus ``σ · √(Σ_k C_k²)`` times
the Gaussian draw of a generator of the same seed, over the expected batch size; over several
optimizer steps, on an MLP, a CNN and a tiny GPT-2, by the methods that can (``grad1`` and
``bookkeeping``); under bfloat16 autocast; one group holding every parameter is the flat step
number for number; and the misuses refused with the model untouched."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import gradhooks.distributed
import gradhooks.pieces
from gradhooks.oracle import loop_grad
from harness import assert_close

SIGMA, E = 0.7, 6.0  # σ, the expected batch size (the divisor)
METHODS = ["grad1", "bookkeeping"]


def quantity(method: str) -> str:
    return "grad1" if method == "grad1" else "norms"


# -- the models, each with its loss and groups ----------------------------------------------------


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)
    ).double()


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=11, n_positions=8,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def classify(out, y):
    return F.cross_entropy(out, y)


def language(out, y):
    """The mean token loss of each example (the batch's mean for one example)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def per_example(model, loss_fn, x, y):
    """Each example's own loss, ``[batch]``."""
    out = model(x)
    if loss_fn is language:
        tokens = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="none")
        return tokens.view(y.shape).mean(1)
    return F.cross_entropy(out, y, reduction="none")


def data(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(
            3, (n,), generator=g
        )
    if kind == "cnn":
        x = torch.randn(n, 2, 5, 5, generator=g, dtype=torch.float64)
        return x, torch.randint(4, (n,), generator=g)
    ids = torch.randint(11, (n, 5), generator=g)
    return ids, torch.randint(11, (n, 5), generator=g)


def gpt2_blocks(model):
    """Blocks of layers by name (fastDP's block-wise clipping): the embeddings, the
    transformer block, the final layer norm."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    blocks = [[n for n in names if n.startswith("transformer.w")], [n for n in names if ".h." in n]]
    return [*blocks, [n for n in names if n not in blocks[0] + blocks[1]]]


MODELS = {
    # kind: (factory, loss, groups (given the model), whether the bounds are one per group)
    "mlp": (mlp, classify, lambda m: "parameter", True),
    "cnn": (cnn, classify, lambda m: "layer", False),
    "gpt2": (gpt2, language, gpt2_blocks, True),
}


# -- the float64 oracle ---------------------------------------------------------------------------


def named_groups(model, groups):
    """The groups as lists of parameter names, in the order of ``named_parameters()``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if groups == "parameter":
        return [[n] for n in names]
    if groups == "layer":
        owners: dict[str, list[str]] = {}
        for n in names:
            owners.setdefault(n.rpartition(".")[0], []).append(n)
        return list(owners.values())
    return groups


def group_norms(loop, groups):
    """``[groups, batch]``: each example's gradient norm of each group's parameters."""
    return torch.stack([torch.cat([loop[n].flatten(1) for n in g], 1).norm(dim=1) for g in groups])


def oracle(model, loss_fn, x, y, groups, bounds, clipping, sigma, noise_gen):
    """Per trainable parameter (``named_parameters()`` order), ``(Σ_i f_ik g_i + σ·C·z) / E``:
    ``f_ik`` the factor of the parameter's group ``k`` for example ``i``, ``C = √(Σ C_k²)``,
    ``z`` drawn from ``noise_gen`` parameter after parameter."""
    loop = loop_grad(model, loss_fn, x, y)
    total = math.sqrt(sum(c * c for c in bounds))
    out = {}
    for g, c, norms in zip(groups, bounds, group_norms(loop, groups), strict=True):
        if clipping == "automatic":
            f = c / (norms + 0.01)
        else:
            f = torch.where(norms > c, c / norms, torch.ones_like(norms))
        for n in g:
            out[n] = torch.einsum("b,b...->...", f, loop[n])
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            z = torch.randn(p.shape, generator=noise_gen, dtype=p.dtype)
            grads[n] = (out[n] + sigma * total * z) / E
    return grads


def bounds_for(model, loss_fn, x, y, groups, per_group):
    """Bounds between the examples' group norms (some clipped, some not), one per group, or
    one float C (each group's bound C/√K) given as a list of the K equal bounds."""
    norms = group_norms(loop_grad(model, loss_fn, x, y), groups)
    if per_group:
        bounds = [n.median().item() for n in norms]
        for n, c in zip(norms, bounds, strict=True):
            assert (n > c).any() and (n < c).any(), "a bound that clips some examples only"
        return bounds, bounds
    c = norms.median().item() * math.sqrt(len(groups))
    return c, [c / math.sqrt(len(groups))] * len(groups)


# -- the steps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt2"])
def test_group_clipped_steps_equal_the_float64_loop(kind, method, clipping):
    """DPOptimizer over three steps with zero_grad: each p.grad against the oracle on a copy
    of the model stepped by the same optimizer on the oracle's gradients; and the grouped
    step is not the flat one (the test could not pass by clipping the whole model)."""
    factory, loss_fn, groups_of, per_group = MODELS[kind]
    model = factory()
    ref = copy.deepcopy(model)
    groups = groups_of(model)
    named = named_groups(model, groups)
    x, y = data(kind, 6, seed=1)
    max_norm, bounds = bounds_for(model, loss_fn, x, y, named, per_group)
    flat = oracle(ref, loss_fn, x, y, [sum(named, [])], [math.hypot(*bounds)], clipping, 0, None)
    grouped = oracle(ref, loss_fn, x, y, named, bounds, clipping, 0, None)
    assert max((flat[n] - grouped[n]).abs().max().item() for n in flat) > 1e-3

    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.5)
    noise, ref_noise = (torch.Generator().manual_seed(7) for _ in range(2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
            dp = gradhooks.DPOptimizer(
                opt, h, max_grad_norm=max_norm, noise_multiplier=SIGMA, expected_batch_size=E,
                generator=noise, method=method, clipping=clipping, clipping_groups=groups,
            )  # fmt: skip
            for step in range(3):
                x, y = data(kind, 6, seed=10 + step)
                want = oracle(ref, loss_fn, x, y, named, bounds, clipping, SIGMA, ref_noise)
                dp.backward(per_example(model, loss_fn, x, y))
                dp.step()
                for n, p in model.named_parameters():
                    assert_close(p.grad, want[n], f"{kind} {method} {clipping} step {step}: {n}")
                for n, p in ref.named_parameters():
                    p.grad = want[n]
                ref_opt.step()
                dp.zero_grad()
                ref_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p, q, f"{kind} {method} {clipping}: {n} after three steps")


@pytest.mark.parametrize("method", METHODS)
def test_one_group_of_every_parameter_is_the_flat_step_number_for_number(method):
    """One group holding every parameter, bound C (as a float or [C]), is the flat step:
    the same norms, the same p.grad, bit for bit (the same sums in the same order)."""
    x, y = data("cnn", 7, seed=2)

    def step(groups=lambda m: None, **kwargs):
        model = cnn()
        with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
            norms = gradhooks.dp_sgd_step(
                h, per_example(model, classify, x, y), noise_multiplier=SIGMA, method=method,
                generator=torch.Generator().manual_seed(3), clipping_groups=groups(model),
                **kwargs,
            )  # fmt: skip
        return norms, [p.grad for p in model.parameters()]

    for clipping in ("flat", "automatic"):
        want_norms, want = step(max_norm=0.4, clipping=clipping)
        for max_norm, groups in (
            (0.4, lambda m: [[n for n, _ in m.named_parameters()]]),
            ([0.4], lambda m: [list(m.parameters())]),
        ):
            norms, got = step(groups, max_norm=max_norm, clipping=clipping)
            assert torch.equal(norms, want_norms)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), f"{method} {clipping}: one group is the flat step"


@pytest.mark.parametrize("method", METHODS)
def test_bf16_autocast_within_bfloat16s_rounding_of_the_float64_loop(method):
    """Under bfloat16 autocast (float32 parameters, bf16 matmuls: 8 significant bits), the
    per-layer clipped sum against the float64 oracle to 5% of its largest entry; the group
    norms are summed in float32, the factors are those of the float64 norms to about 1%."""
    x, y = data("mlp", 8, seed=4)
    model64 = mlp()
    named = named_groups(model64, "parameter")
    _, bounds = bounds_for(model64, classify, x, y, named, True)
    want = oracle(model64, classify, x, y, named, bounds, "flat", 0.0, None)
    model = mlp().float()
    with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = F.cross_entropy(model(x.float()), y, reduction="none")
        gradhooks.dp_sgd_step(
            h, losses.float(), max_norm=bounds, noise_multiplier=0.0, method=method,
            clipping_groups="parameter", expected_batch_size=E,
        )  # fmt: skip
    for n, p in model.named_parameters():
        err = (p.grad.double() - want[n]).abs().max() / want[n].abs().max()
        assert err < 5e-2, f"{method}: {n} off by {err:.3g} (bf16: 8 significant bits)"


@pytest.mark.parametrize("method", METHODS)
def test_float16_with_a_grad_scaler_clips_the_unscaled_group_norms(method):
    """float16 autocast with a GradScaler (scale 2¹⁰): the group norms and factors are those
    of the unscaled gradients, p.grad is written scaled, the noise drawn on the total bound:
    within 16 float16 epsilons (11 significant bits) of the float64 oracle's largest entry."""
    x, y = data("mlp", 8, seed=4)
    model64 = mlp()
    named = named_groups(model64, "layer")
    _, bounds = bounds_for(model64, classify, x, y, named, True)
    sigma, seed = 0.5, 5
    want = oracle(model64, classify, x, y, named, bounds, "flat", 0.0, None)
    model = mlp().float()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x.float())
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(out.float(), y, reduction="none"), max_norm=bounds,
            noise_multiplier=sigma, method=method, clipping_groups="layer", scaler=scaler,
            generator=torch.Generator().manual_seed(seed), expected_batch_size=E,
        )  # fmt: skip
    noise = torch.Generator().manual_seed(seed)
    total = math.hypot(*bounds)
    for n, p in model.named_parameters():
        z = torch.randn(p.shape, generator=noise).double() * sigma * total / E
        got = p.grad.double() / 2.0**10 - z
        bound = 16 * torch.finfo(torch.float16).eps * float(want[n].abs().max())
        assert float((got - want[n]).abs().max()) <= bound, f"{method}: {n}"


@pytest.mark.parametrize("method", METHODS)
def test_an_empty_batch_steps_on_the_noise_of_the_total_bound(method):
    model = mlp()
    x, y = data("mlp", 0, seed=1)
    with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
        norms = gradhooks.dp_sgd_step(
            h, per_example(model, classify, x, y), max_norm=[1.0, 2.0], noise_multiplier=SIGMA,
            method=method, clipping_groups="layer", expected_batch_size=E,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    assert norms.shape == (0,)
    noise = torch.Generator().manual_seed(0)
    for n, p in model.named_parameters():
        z = torch.randn(p.shape, generator=noise, dtype=p.dtype)
        assert_close(p.grad, SIGMA * math.sqrt(5.0) * z / E, f"{method}: noise alone, {n}")


@pytest.mark.parametrize("method", METHODS)
def test_a_grouped_step_reads_nothing_back_from_the_device(monkeypatch, method):
    """Steady-state grouped steps (the 5th to 7th) read no value back to the host, as the
    flat step does not (tests/test_host_syncs.py's count, the CPU taken for a device)."""
    from test_host_syncs import Reads

    monkeypatch.setattr(gradhooks.devices, "on_cpu", lambda t: False)
    reads = Reads(monkeypatch)
    model = mlp().float()
    x, y = data("mlp", 5, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
        for step in range(1, 9):
            reads.on = 5 <= step <= 7
            gradhooks.dp_sgd_step(
                h, per_example(model, classify, x.float(), y), max_norm=[0.5, 0.1, 0.3, 0.2],
                noise_multiplier=1.0, method=method, clipping_groups="parameter",
            )  # fmt: skip
            opt.step()
    reads.on = False
    assert reads.where == []


def test_distributed_step_on_one_rank_is_the_grouped_step(tmp_path):
    """gradhooks.distributed.dp_sgd_step with clipping_groups, on a one-process gloo group:
    the grouped step of one process, the noise scaled to the total bound."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    x, y = data("mlp", 6, seed=5)
    model = mlp()
    named = named_groups(model, "layer")
    _, bounds = bounds_for(model, classify, x, y, named, True)
    want = oracle(
        model, classify, x, y, named, bounds, "flat", SIGMA, torch.Generator().manual_seed(9)
    )
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
    try:
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            gradhooks.distributed.dp_sgd_step(
                h, per_example(model, classify, x, y), max_norm=bounds, noise_multiplier=SIGMA,
                generator=torch.Generator().manual_seed(9), expected_batch_size=E,
                clipping_groups="layer",
            )  # fmt: skip
    finally:
        if started:
            dist.destroy_process_group()
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n], f"distributed: {n}")


def test_opacus_per_layer_clipping_is_the_parameter_groups_step():
    """Opacus' make_private(clipping="per_layer", max_grad_norm=[...]) and
    clipping_groups="parameter" with the same bounds give the same clipped mean, but for
    Opacus' 1e-6 added to each norm (its factor C/(‖g‖ + 1e-6)): relatively 1e-6/‖g‖ at most."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    x, y = data("mlp", 6, seed=1)
    model = mlp()
    named = named_groups(model, "parameter")
    bounds, _ = bounds_for(model, classify, x, y, named, True)
    smallest = group_norms(loop_grad(model, classify, x, y), named).min().item()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Opacus' notes: secure_mode off, ...)
        private, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0,
            max_grad_norm=bounds, clipping="per_layer", poisson_sampling=False,
        )  # fmt: skip
        F.cross_entropy(private(x), y).backward()
        opt.pre_step()  # (the clipping, the noise and the division, without the step)
    ours = mlp()
    with gradhooks.add_hooks(ours, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(h, F.cross_entropy(ours(x), y, reduction="none"), max_norm=bounds,
                              noise_multiplier=0.0, clipping_groups="parameter")  # fmt: skip
    for (n, p), theirs in zip(ours.named_parameters(), opt.params, strict=True):
        err = ((p.grad - theirs.grad).abs().max() / theirs.grad.abs().max()).item()
        assert err <= 2e-6 / smallest, f"{n}: {err:.2e} from Opacus' per-layer step"


# -- what is refused ------------------------------------------------------------------------------


def refused(model, method, match, error=gradhooks.ConfigurationError, **kwargs):
    """The step refuses, naming what ``match`` says, and writes nothing: ``.grad`` is what
    it was, and the same losses then step."""
    x, y = data("mlp", 5, seed=6)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    with gradhooks.add_hooks(model, quantities=(quantity(method),)) as h:
        losses = per_example(model, classify, x, y)
        with pytest.raises(error, match=match):
            gradhooks.dp_sgd_step(h, losses, noise_multiplier=1.0, method=method, **kwargs)
        assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
        gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0, method=method)


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
def test_bad_groups_and_bounds_are_refused_with_the_parameter_named(method):
    model = mlp()
    w0, b0, w2, b2 = model.parameters()
    refused(model, method, r"'2\.bias' of the hooked model is in no clipping group",
            max_norm=1.0, clipping_groups=[[w0, b0], [w2]])  # fmt: skip
    refused(model, method, r"'0\.bias' is in clipping group 0 .* again in group 1",
            max_norm=1.0, clipping_groups=[[w0, b0], [w2, b2, "0.bias"]])  # fmt: skip
    refused(model, method, r"names '0\.scale', which is no parameter",
            max_norm=1.0, clipping_groups=[["0.weight", "0.scale"], [b0, w2, b2]])  # fmt: skip
    refused(model, method, r"not the hooked Sequential's",
            max_norm=1.0, clipping_groups=[[w0, b0, w2, b2, nn.Parameter(torch.ones(2))]])  # fmt: skip
    refused(model, method, r"max_norm\[1\] = 0\.0", max_norm=[1.0, 0.0, 1.0, 1.0],
            clipping_groups="parameter")  # fmt: skip
    refused(model, method, r"max_norm\[0\] = -1", max_norm=[-1, 2.0], clipping_groups="layer")
    refused(model, method, r"max_norm has 3 bounds but clipping_groups='parameter' makes 4",
            max_norm=[1.0, 1.0, 1.0], clipping_groups="parameter")  # fmt: skip
    refused(model, method, "no clipping_groups were given", max_norm=[1.0, 1.0])
    refused(model, method, "clipping_groups must be None, 'parameter', 'layer'",
            max_norm=1.0, clipping_groups="block")  # fmt: skip
    refused(model, method, "clipping group 0 is a Parameter, not a list",
            error=gradhooks.ConfigurationTypeError, max_norm=1.0,
            clipping_groups=[w0, b0, w2, b2])  # fmt: skip
    refused(model, method, "clipping group 1 is empty", max_norm=1.0,
            clipping_groups=[[w0, b0, w2, b2], []])  # fmt: skip


def test_ghost_clipping_refuses_more_than_one_group_and_takes_one():
    """Ghost clipping's second backward has one factor per example: more than one group is
    refused, naming the methods that can; one group is the flat ghost step."""
    model = mlp()
    refused(model, "ghost", r"method='bookkeeping'", max_norm=1.0, clipping_groups="layer")
    x, y = data("mlp", 5, seed=6)
    grads = []
    for one_group in (False, True):
        m = mlp()
        groups = [list(m.parameters())] if one_group else None
        with gradhooks.add_hooks(m, quantities=("norms",)) as h:
            gradhooks.dp_sgd_step(h, per_example(m, classify, x, y), max_norm=0.3,
                                  noise_multiplier=0.0, method="ghost", clipping_groups=groups)  # fmt: skip
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_a_frozen_parameter_in_a_group_is_left_out_and_optimizer_groups_serve():
    """An optimizer's param_groups as the groups; a frozen parameter in one of them has no
    gradient and is left out (its group is clipped on the others)."""
    model = mlp()
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([{"params": [model[0].weight, model[0].bias]},
                           {"params": list(model[2].parameters()), "lr": 0.1}], lr=0.2)  # fmt: skip
    x, y = data("mlp", 6, seed=8)
    named = [["0.weight"], ["2.weight", "2.bias"]]
    _, bounds = bounds_for(model, classify, x, y, named, True)
    want = oracle(model, classify, x, y, named, bounds, "flat", 0.0, None)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(h, per_example(model, classify, x, y), max_norm=bounds,
                              noise_multiplier=0.0, clipping_groups=opt.param_groups,
                              expected_batch_size=E)  # fmt: skip
    assert model[0].bias.grad is None
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, want[n], f"optimizer groups: {n}")


# -- DPOptimizer and make_private -----------------------------------------------------------------


def test_dp_optimizer_refuses_bad_groups_at_construction():
    model = mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(gradhooks.ConfigurationError, match="in no clipping group"):
            gradhooks.DPOptimizer(opt, h, max_grad_norm=1.0, noise_multiplier=1.0,
                                  expected_batch_size=E, clipping_groups=[[model[0].weight]])  # fmt: skip
        with pytest.raises(gradhooks.ConfigurationError, match="max_grad_norm has 1 bounds but"):
            gradhooks.DPOptimizer(opt, h, max_grad_norm=[1.0], noise_multiplier=1.0,
                                  expected_batch_size=E, clipping_groups="parameter")  # fmt: skip
        with pytest.raises(gradhooks.ConfigurationError, match="method='bookkeeping'"):
            gradhooks.DPOptimizer(opt, h, max_grad_norm=[1.0, 1.0], noise_multiplier=1.0,
                                  expected_batch_size=E, method="ghost", clipping_groups="layer")  # fmt: skip


def hooks_on(model):
    """The hooks a model's modules and parameters hold."""
    return [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in model.modules()
    ] + [len(p._backward_hooks or {}) for p in model.parameters()]


def dataset(n=24):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randint(3, (n,), generator=g))


def test_make_private_keeps_the_groups_in_its_checkpoint_plan():
    """The plan of a checkpoint holds the bounds and the groups (parameters by their names):
    a run with the same resumes, one with other groups or bounds is refused; the accountant
    records σ alone, relative to the total bound (ε as for one bound)."""

    model = mlp()
    before = hooks_on(model)
    with pytest.raises(gradhooks.ConfigurationError, match=r"'0\.bias' .* in no clipping group"):
        gradhooks.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=1.0,
            delta=1e-5, steps=3, expected_batch_size=E, max_grad_norm=[1.0, 1.0],
            clipping_groups=[["0.weight"], ["2.weight", "2.bias"]],
        )  # fmt: skip
    assert hooks_on(model) == before, "a refused run leaves no hook on the model"

    def run(model=None, **kwargs):
        model = mlp() if model is None else model
        return gradhooks.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=1.0,
            delta=1e-5, steps=3, expected_batch_size=E, generator=torch.Generator().manual_seed(0),
            **kwargs,
        )  # fmt: skip

    bounds = [0.5, 0.2, 0.4, 0.1]
    a = run(max_grad_norm=bounds, clipping_groups="parameter")
    for x, y in a.batches():
        a.backward(F.cross_entropy(a.model(x), y, reduction="none"))
        a.step()
        break
    state = a.state_dict()
    assert state["plan"]["max_grad_norm"] == bounds
    assert state["plan"]["clipping_groups"] == "parameter"
    flat = run(max_grad_norm=math.hypot(*bounds))
    for x, y in flat.batches():
        flat.backward(F.cross_entropy(flat.model(x), y, reduction="none"))
        flat.step()
        break
    assert a.accountant.state_dict() == flat.accountant.state_dict()
    a.close()
    flat.close()
    b = run(max_grad_norm=bounds, clipping_groups="parameter")
    b.load_state_dict(state)
    assert b.steps_taken == 1
    b.close()
    model = mlp()
    groups = [[model[0].weight, model[0].bias], list(model[2].parameters())]
    c = run(model, max_grad_norm=[0.5, 0.4], clipping_groups=groups)
    assert c.state_dict()["plan"]["clipping_groups"] == [
        ["0.weight", "0.bias"],
        ["2.weight", "2.bias"],
    ]
    for other in (run(max_grad_norm=[0.5, 0.4], clipping_groups="layer"),
                  run(max_grad_norm=[0.5, 0.2, 0.4, 0.2], clipping_groups="parameter"),
                  run(max_grad_norm=1.0)):  # fmt: skip
        with pytest.raises(gradhooks.ConfigurationError, match="checkpoint's"):
            other.load_state_dict(state)
        other.close()
    c.close()

"""gradhooks.kfac with any loss: a function ``loss(output, target)`` of a batch of one (every
fisher it supports), targets sampled by the user (``sample_target``) and the user's own sampled
output-gradients (``output_grads``); checked in float64 against a per-example loop through the
hooks, the GGN from ``torch.autograd.functional`` Jacobians and Hessians, and the built-in
losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from harness import assert_close

D = torch.float64


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 4)
    ).to(D)


def smoothed(out, y):  # label-smoothed cross-entropy of a batch of one
    return F.cross_entropy(out, y, label_smoothing=0.2)


def multi_label(out, y):  # several independent binary labels per example
    return F.binary_cross_entropy_with_logits(out, y, reduction="sum")


def quartic(out, y):  # convex, with a Hessian that is neither diagonal nor cross-entropy's
    return F.cross_entropy(out, y) + 0.1 * (out**4).sum()


LOSSES = {
    "smoothed": (smoothed, lambda b: torch.randint(4, (b,))),
    "multi-label": (multi_label, lambda b: torch.randint(2, (b, 4)).to(D)),
    "quartic": (quartic, lambda b: torch.randint(4, (b,))),
}


def assert_factors_equal(got, want, what):
    assert set(got) == set(want), f"{what}: {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        assert got[name].bias == w.bias and got[name].bias_name == w.bias_name, name
        assert_close(got[name].A, w.A, f"{what}: A of {name}")
        assert_close(got[name].G, w.G, f"{what}: G of {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_empirical_factors_of_a_function_loss_are_those_of_its_per_example_backward(
    loss, reduction
):
    """The oracle: the hooks' factors of one backward of the sum of every example's own loss,
    each computed on its own (a loop), ``loss(out[i:i+1], y[i:i+1])``."""
    fn, targets = LOSSES[loss]
    torch.manual_seed(0)
    model, x, y = conv_net(), torch.randn(5, 2, 4, 4, dtype=D), targets(5)
    got = gradhooks.kfac(model, x, y, fisher="empirical", loss=fn, reduction=reduction)
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        out = model(x)
        sum(fn(out[i : i + 1], y[i : i + 1]) for i in range(5)).backward()
        want = h.kfac_factors(reduction)
    assert_factors_equal(got, want, f"empirical, {loss}")


def ggn_of_one_example(model, x, loss_of_output):
    """{weight: Jᵀ H J} of one example: J the Jacobian of the output with respect to the
    weight, H the loss's Hessian with respect to the output (torch.autograd.functional)."""
    from torch.autograd.functional import hessian, jacobian

    params = {n: p.detach() for n, p in model.named_parameters()}
    with gradhooks.paused():
        out = model(x)[0].detach()
        H = hessian(loss_of_output, out)  # [C, C]
        result = {}
        for name, p in params.items():
            f = lambda w, name=name: torch.func.functional_call(model, {**params, name: w}, (x,))[0]
            J = jacobian(f, p).flatten(1)  # [C, P]
            result[name] = J.T @ H @ J
    return result


@pytest.mark.parametrize("loss", list(LOSSES))
def test_exact_factors_of_one_example_are_its_ggn_for_a_function_loss(loss):
    """K-FAC is exact for one example of any network where every weight sees one position
    (Linear layers): kron(G, A) is the GGN block, here with the loss's own Hessian."""
    fn, targets = LOSSES[loss]
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).to(D)
    x, y = torch.randn(1, 3, dtype=D), targets(1)
    factors = gradhooks.kfac(model, x, y, fisher="exact", loss=fn, reduction="sum", bias=False)
    ggn = ggn_of_one_example(model, x, lambda o: fn(o[None], y))
    for name, f in factors.items():
        assert_close(torch.kron(f.G, f.A), ggn[name], f"K-FAC vs GGN, {loss}, {name}")


@pytest.mark.parametrize("fisher", ["empirical", "exact"])
@pytest.mark.parametrize(
    "name, fn",
    [("cross_entropy", F.cross_entropy), ("mse", lambda o, t: F.mse_loss(o, t, reduction="sum"))],
    ids=["cross_entropy", "mse"],
)
def test_a_function_loss_gives_the_named_losses_factors(name, fn, fisher):
    torch.manual_seed(2)
    model, x = conv_net(), torch.randn(5, 2, 4, 4, dtype=D)
    y = torch.randint(4, (5,)) if name == "cross_entropy" else torch.randn(5, 4, dtype=D)
    want = gradhooks.kfac(model, x, y, fisher=fisher, loss=name)
    got = gradhooks.kfac(model, x, y, fisher=fisher, loss=fn)
    assert_factors_equal(got, want, f"{fisher}, {name} as a function")


@pytest.mark.parametrize("dtype", [torch.float32, D], ids=["float32", "float64"])
def test_exact_factors_of_a_saturated_softmax_are_not_refused(dtype):
    """Logits far apart: each example's cross-entropy Hessian is about 1e-14 (float64), its
    eigenvalues' rounding of about the same size, some negative. Rounding, not a loss that is
    not convex: the factors are the built-in loss's."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).to(dtype)
    with torch.no_grad():
        model[2].weight.mul_(40)
    x, y = torch.randn(8, 3, dtype=dtype), torch.randint(4, (8,))
    want = gradhooks.kfac(model, x, y, fisher="exact")
    got = gradhooks.kfac(model, x, y, fisher="exact", loss=F.cross_entropy)
    for name, w in want.items():
        torch.testing.assert_close(got[name].A, w.A, msg=f"A of {name}")
        scale = w.G.abs().max()
        torch.testing.assert_close(got[name].G, w.G, atol=1e-5 * scale, rtol=0, msg=name)


def cross_entropy_labels(out, generator):  # what the built-in "mc" draws, in the same order
    probs = torch.softmax(out, -1).reshape(-1, out.shape[-1])
    return torch.multinomial(probs, 1, generator=generator)[:, 0].view(out.shape[:-1])


class Sequence(nn.Module):
    """Tokens [batch, seq] -> logits [batch, seq, 6]; positions mix (a running sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.out = nn.Embedding(7, 4), nn.Linear(4, 5), nn.Linear(5, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.embed(x))).cumsum(1))


@pytest.mark.parametrize("output", ["classes", "sequence"])
@pytest.mark.parametrize("how", ["sample_target", "sample_target, function loss", "output_grads"])
def test_mc_from_sampled_targets_or_output_gradients_equals_the_built_in_sampling(how, output):
    """The same labels drawn by the user (sample_target) or their gradients given
    (output_grads): the same factors as the built-in sampling, three samples averaged."""
    torch.manual_seed(3)
    if output == "classes":
        model, x = conv_net(), torch.randn(5, 2, 4, 4, dtype=D)
    else:
        model, x = Sequence().to(D), torch.randint(7, (3, 4))
    run = lambda **kw: gradhooks.kfac(
        model, x, fisher="mc", mc_samples=3, generator=torch.Generator().manual_seed(4), **kw
    )
    want = run()
    if how == "sample_target":
        got = run(sample_target=cross_entropy_labels)
    elif how == "sample_target, function loss":
        summed = lambda o, y: F.cross_entropy(o.flatten(0, -2), y.flatten(), reduction="sum")
        got = run(loss=summed, sample_target=cross_entropy_labels)
    else:
        one_hot = lambda out, g: F.one_hot(cross_entropy_labels(out, g), out.shape[-1])
        got = run(output_grads=lambda out, g: torch.softmax(out, -1) - one_hot(out, g))
    assert_factors_equal(got, want, how)


def test_errors_say_what_a_function_loss_supports_and_what_to_do():
    torch.manual_seed(5)
    model, x, y = conv_net(), torch.randn(3, 2, 4, 4, dtype=D), torch.randint(4, (3,))
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"fisher='mc', loss=smoothed.*sample_target=.*'exact'"
    ):
        gradhooks.kfac(model, x, y, loss=smoothed)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.kfac(model, x, fisher="exact", sample_target=cross_entropy_labels)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.kfac(model, x, sample_target=cross_entropy_labels, output_grads=lambda o, g: o)
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"output_grads=\.\.\.\) returned \(3,\).*\(3, 4\)"
    ):
        gradhooks.kfac(model, x, output_grads=lambda out, g: out[:, 0])
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.kfac(model, x, loss="nll")
    concave = lambda out, t: -F.mse_loss(out, t, reduction="sum")
    with pytest.raises(
        gradhooks.ConfigurationError,
        match=r"example 0 has a negative eigenvalue \(-2;.*fisher='mc'",
    ):
        gradhooks.kfac(model, x, torch.randn(3, 4, dtype=D), fisher="exact", loss=concave)
    with pytest.raises(gradhooks.UnsupportedError):
        gradhooks.kfac(model, x, y, fisher="empirical", loss=lambda o, t: o.sum() * o.sum().item())

"""A thirteenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd,
``torch.autograd.functional.hessian`` and :mod:`gradhooks.oracle`). The first twelve sets are
:mod:`test_peer_suites`, :mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to
:mod:`test_peer_suites_twelfth`; this one adds:

- autograd-lib (``cybertronai/autograd-lib``: ``autograd_lib_test.py``, ``util.py``,
  ``autograd_lib/autograd_lib.py``), autograd-hacks' successor: the Hessian of a linear and of
  a ReLU network under the mean cross-entropy, whole and its diagonal, over two steps, from the
  per-example backprops of the loss Hessian's square root (``backward_hessian``, gradhooks'
  ``backprop_hess`` / ``compute_hess`` and its per-example Jacobians); K-FAC exact for one
  datum repeated, also with the layer as GPT-2's ``Conv1D`` or loralib's ``fan_in_fan_out``
  Linear (a weight ``[in, out]``) against its Linear twin, for the several backwards of
  ``"exact"`` and ``"mc"``, batched and one at a time, over positions expanded and reduced;
  the squared Jacobian of its toy network (``backward_jacobian``) equal to the least-squares
  Hessian; the empirical Fisher accumulated one example at a time (its ``SimpleMLP``
  reshapes an unbatched example to a batch of one: refused, with the remedy); the
  per-example norms of ``example_norms.py`` by Goodfellow's trick;
- bergson (``EleutherAI/bergson``: ``tests/test_gradients.py``, ``test_moe.py``,
  ``test_outer_product_gradients.py``, ``test_batch_size_invariance.py``,
  ``bergson/gradients.py``): per-example gradients of Linears over sequences normalized by
  Adam's second moments (and their Adafactor factoring) with the bias as an extra column,
  randomly projected (``L [G | b] Rᵀ``), of padded sequences whose loss a mask selects, per
  sequence, per token and per attention head; the model left as it was after hooked batches;
  per-example norms and query dot products of a GPT-NeoX with a bias removed, its padded batch
  against each sequence alone; gradients that do not depend on the batching; and the
  mixture-of-experts models of transformers with fused expert weights (gpt-oss: transposed,
  biased, a biased router; Mixtral; OLMoE; Qwen3-MoE; DeepSeek-V3: a sigmoid router with a
  score-correction buffer and a shared expert), ``grad1`` of every expert and router against
  the loop (also in float32 with transformers' default experts kernel), their norms, the
  model's outputs and modules unchanged by the hooks, and K-FAC of the router (the fused
  experts left out, said); K-FAC (``ekfac_tests/``) of a ``Conv1D`` over the real positions
  of a padded batch, of modules reading one input and of a module called twice, and the
  sampled Fisher only where the labels have a loss;
- ASDL (``kazukiosawa/asdl``: ``tests/test_param_grad_w_fisher_emp.py``,
  ``test_shape_selection_in_ngd.py``): on its convnet, the empirical Fisher's full,
  layer-wise and diagonal shapes in the backward that gives ``.grad``, and the exact Fisher
  from the per-example Jacobians.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (  # noqa: F401
    Logits,
    assert_close,
    flat_grads,
    grad1_of,
    hf,
    one_thread,
    raised,
    seeded,
)

D = torch.float64


# == autograd-lib: autograd_lib_test.py, util.py ================================================


class SimpleMLP(nn.Module):
    """autograd-lib's ``util.SimpleMLP``: Linear layers of widths ``d``, a ReLU after each with
    ``nonlin`` (the last too), the input reshaped to ``[-1, d[0]]`` (an image, or one example
    given alone, becomes a batch)."""

    def __init__(self, d, nonlin=False, bias=False):
        super().__init__()
        self.d = d
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(d, d[1:]))
        parts = []
        for layer in self.layers:
            parts += [layer, nn.ReLU()] if nonlin else [layer]
        self.predict = nn.Sequential(*parts)

    def forward(self, x):
        return self.predict(x.reshape(-1, self.d[0]))


def hess_sqrt_ce(out: Tensor) -> Tensor:
    """autograd-lib's ``backward_hessian(loss='CrossEntropy')`` factor ``S``: ``[n, o, o]``,
    ``S[j, k] = √p_j (δ_jk - p_k)``, whose rows it backpropagates: ``Sᵀ S = diag(p) - p pᵀ``,
    each example's cross-entropy Hessian with respect to the logits."""
    p = F.softmax(out.detach(), 1)
    n, o = p.shape
    return torch.diag_embed(p.sqrt()) - torch.einsum("ij,ik->ijk", p.sqrt(), p)


def tiny_images(n: int, width: int = 3, seed: int = 0):
    """``TinyMNIST``'s shape: ``n`` images ``[width, width]`` in ``[0, 1]`` and labels of 10
    classes (drawn here; the peer downsamples MNIST)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, width, width, generator=g, dtype=D), torch.randint(10, (n,), generator=g)


def hessian_of(loss_of, param: Tensor) -> Tensor:
    """The Hessian ``[numel, numel]`` of ``loss_of(value)`` at ``param``'s value (the weight
    substituted into the model by ``loss_of``)."""
    h = hessian(loss_of, param.detach().clone())
    return h.reshape(param.numel(), param.numel())


def with_param(model: nn.Module, name: str, value: Tensor, x: Tensor) -> Tensor:
    """``model(x)`` with the parameter ``name`` replaced by ``value``, on a copy (not
    ``functional_call``: ``SimpleMLP`` holds each layer under two names, ``layers.i`` and
    ``predict.j``, and ``functional_call`` then leaves a plain tensor in the parameter's
    place)."""
    copy = deepcopy(model)
    owner, attr = name.rsplit(".", 1)
    module = copy.get_submodule(owner)
    delattr(module, attr)
    setattr(module, attr, value)
    return copy(x)


def test_autograd_lib_hessian_full():
    """``test_hessian_full``: a linear ``SimpleMLP([9, 10], bias=True)`` on a batch of two
    3x3 images under the mean cross-entropy; the Hessian with respect to the weight, formed
    from the per-example backprops of the loss Hessian's square root (``param.hess`` of
    ``backprop_hess`` / ``compute_hess``, autograd-lib's ``Σ (B⊗A)(B⊗A)ᵀ / n``), is
    autograd's; the bias's too."""
    model = seeded(lambda: SimpleMLP([9, 10], bias=True)).to(D)
    x, y = tiny_images(2)
    with gradhooks.add_hooks(model):
        out = model(x)
        gradhooks.backprop_hess(out, "CrossEntropy")
        gradhooks.compute_hess(model)
    layer = model.layers[0]
    for name, p in (("layers.0.weight", layer.weight), ("layers.0.bias", layer.bias)):
        want = hessian_of(
            lambda v, n=name, x=x, y=y: F.cross_entropy(with_param(model, n, v, x), y), p
        )
        assert_close(p.hess, want, f"{name}: compute_hess against autograd's Hessian")


def test_autograd_lib_hessian_diag_two_steps():
    """``test_hessian_diag``: ``SimpleMLP([9, 6, 10], nonlin=True, bias=True)`` (a ReLU after
    each layer, so the Gauss-Newton blocks are the Hessian's), two steps of a batch of two;
    each layer's Hessian and its diagonal (autograd-lib's ``Σ B² ⊗ A²``) against autograd's,
    from ``compute_hess`` and from gradhooks' per-example Jacobians
    (``Σ_n J_nᵀ S_n S_nᵀ J_n / n``)."""
    model = seeded(lambda: SimpleMLP([9, 6, 10], nonlin=True, bias=True)).to(D)
    x_all, y_all = tiny_images(4, seed=1)
    for step in range(2):
        x, y = x_all[2 * step : 2 * step + 2], y_all[2 * step : 2 * step + 2]
        with gradhooks.add_hooks(model):
            gradhooks.clear_backprops(model)
            out = model(x)
            gradhooks.backprop_hess(out, "CrossEntropy")
            gradhooks.compute_hess(model)
        jac = gradhooks.jacobians(model, x)  # {name: [n, 10, *shape]}
        s = hess_sqrt_ce(model(x))  # [n, o, o]
        for i, layer in enumerate(model.layers):
            name = f"layers.{i}.weight"
            want = hessian_of(
                lambda v, n=name, x=x, y=y: F.cross_entropy(with_param(model, n, v, x), y),
                layer.weight,
            )
            assert_close(layer.weight.hess, want, f"step {step}, {name}: compute_hess")
            j = jac[name].flatten(2)  # [n, o, P]
            sj = torch.einsum("nco,nop->ncp", s, j)  # (rows of S: Σ_c S_cᵀ S_c = H)
            ggn = torch.einsum("ncp,ncq->pq", sj, sj) / len(x)
            assert_close(ggn, want, f"step {step}, {name}: from the Jacobians")
            diag = torch.einsum("ncp,ncp->p", sj, sj) / len(x)
            assert_close(diag, want.diagonal(), f"step {step}, {name}: the diagonal")
        model.zero_grad()


def test_autograd_lib_hessian_kfac_of_one_repeated_datum():
    """``test_hessian_kfac``: ``SimpleMLP([2, 2], nonlin=True, bias=True)`` (a ReLU on its
    output) with the identity as weight, one datum (the logits of ``[0.7, 0.3]``) repeated
    three times with label 0: K-FAC (``fisher="exact"``, the bias a column of ``A``) is the
    Hessian of the mean cross-entropy with respect to ``[W | b]``, whole and its diagonal."""
    model = seeded(lambda: SimpleMLP([2, 2], nonlin=True, bias=True)).to(D)
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.eye(2, dtype=D))
        model.layers[0].bias.copy_(torch.tensor([0.3, 0.2], dtype=D))  # (a ReLU that passes)
    p = torch.tensor([[0.7, 0.3]], dtype=D)
    data = (p.log() - p[:, -1:].log()).repeat(3, 1)  # autograd-lib's to_logits
    targets = torch.zeros(3, dtype=torch.long)
    f = gradhooks.kfac(model, data, targets, fisher="exact", reduction="mean")
    k = f["layers.0.weight"]
    assert k.bias and k.A.shape == (3, 3) and k.G.shape == (2, 2)
    w, b = model.layers[0].weight.detach(), model.layers[0].bias.detach()

    def loss_of(wb):
        out = F.relu(data @ wb[:, :2].T + wb[:, 2])
        return F.cross_entropy(out, targets)

    want = hessian_of(loss_of, torch.cat([w, b[:, None]], 1))
    assert_close(torch.kron(k.G, k.A), want, "kron(G, A) against the Hessian")
    assert_close(torch.kron(k.G.diagonal(), k.A.diagonal()), want.diagonal(), "the diagonal")


class ConvMLP(nn.Module):
    """A Linear (``"linear"``) or GPT-2's ``Conv1D`` (``"conv1d"``, the weight ``[in, out]``,
    ``torch.addmm(b, x, W)``) from 3 to 5 features, a tanh, a Linear to 4 classes: the same
    function for the same weights."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "conv1d":
            self.first = pytest.importorskip("transformers.pytorch_utils").Conv1D(5, 3)
        elif kind == "loralib":  # (microsoft/LoRA's layer on GPT-2's [in, out] weight)
            lora = pytest.importorskip("loralib")
            self.first = lora.Linear(3, 5, r=2, fan_in_fan_out=True, merge_weights=False)
            self.first.weight.requires_grad_(True)
        else:
            self.first = nn.Linear(3, 5)
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.head(h.mean(1) if h.dim() == 3 else h)  # (positions pooled)


def conv_mlp_pair(kind: str = "conv1d") -> tuple[ConvMLP, ConvMLP]:
    linear = seeded(lambda: ConvMLP("linear")).to(D)
    conv = ConvMLP(kind).to(D)
    with torch.no_grad():
        conv.first.weight.copy_(linear.first.weight.T)
        conv.first.bias.copy_(linear.first.bias)
        conv.head.load_state_dict(linear.head.state_dict())
    return linear, conv


@pytest.mark.parametrize("batched", [True, False], ids=["vmapped", "one-at-a-time"])
@pytest.mark.parametrize("fisher", ["exact", "mc", "empirical"])
@pytest.mark.parametrize("kind", ["conv1d", "loralib"])
def test_autograd_lib_kfac_of_a_conv1d_as_of_its_linear(kind, fisher, batched):
    """``test_hessian_kfac``'s one datum repeated (K-FAC then the Hessian's GGN block), with
    the first layer as GPT-2's ``Conv1D``: its factors are its Linear twin's with the roles
    swapped (``G`` over the inputs is the Linear's ``A``, ``A`` over the output-gradients the
    Linear's ``G``), for every ``fisher``: the four columns of the Hessian's square root
    (``"exact"``) and three sampled labels (``"mc"``, one generator for both) are several
    backwards of one forward, which the Conv1D's ``A`` must sum over; batched under ``vmap``
    and one at a time (``kfac_vmap_elements=1``). ``kron(G, A)`` of the repeated datum is
    autograd's GGN block of the weight ``[in, out]``, and of a batch of four, the Linear's.
    The same of loralib's ``Linear`` with ``fan_in_fan_out`` (the LoRA of GPT-2's layers, its
    weight ``[in, out]`` and trained here; ``lora_B`` zero, so the same function)."""
    linear, conv = conv_mlp_pair(kind)
    p = torch.tensor([[0.5, -1.0, 2.0]], dtype=D)
    for x in (
        p.repeat(3, 1),
        torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(5)),
    ):
        y = torch.tensor([1] * len(x))
        kwargs = dict(fisher=fisher, reduction="mean", bias=False)
        if fisher == "mc":
            kwargs["mc_samples"] = 3
        with gradhooks.tuned(**({} if batched else {"kfac_vmap_elements": 1})):
            got = gradhooks.kfac(conv, x, y, generator=torch.Generator().manual_seed(7),
                                 **kwargs)["first.weight"]  # fmt: skip
            twin = gradhooks.kfac(linear, x, y, generator=torch.Generator().manual_seed(7),
                                  **kwargs)["first.weight"]  # fmt: skip
        assert got.G.shape == (3, 3) and got.A.shape == (5, 5)
        assert_close(got.G, twin.A, f"{len(x)} examples: Conv1D G against the Linear's A")
        assert_close(got.A, twin.G, f"{len(x)} examples: Conv1D A against the Linear's G")
    if fisher == "exact" and kind == "conv1d":  # (the datum repeated: exact)
        x = p.repeat(3, 1)
        got = gradhooks.kfac(conv, x, fisher="exact", reduction="mean", bias=False)
        w = conv.first.weight

        def logits(v):
            return conv.head(torch.tanh(x @ v + conv.first.bias))

        j = torch.autograd.functional.jacobian(logits, w.detach().clone())[0].reshape(4, -1)
        s = hess_sqrt_ce(logits(w.detach()))[0]
        ggn = j.T @ s.T @ s @ j
        assert_close(torch.kron(got["first.weight"].G, got["first.weight"].A), ggn,
                     "kron(G, A) of the datum against its GGN")  # fmt: skip


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["exact", "mc"])
def test_autograd_lib_kfac_of_a_conv1d_over_positions(fisher, expand):
    """The same twins on sequences of three positions pooled before the head, where the
    factors of a Conv1D and of its Linear twin differ by the positions (its ``G`` sums the
    inputs as an output-gradient is summed, its ``A`` averages the output-gradients as an
    input is averaged) but their product does not: ``kron(A, G)`` of the Conv1D (its output
    side first) is ``kron(G, A)`` of the Linear, expanded and reduced, for the several
    backwards of ``"exact"`` and ``"mc"``."""
    linear, conv = conv_mlp_pair()
    x = torch.randn(4, 3, 3, dtype=D, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([0, 3, 1, 2])
    kwargs = dict(fisher=fisher, reduction="mean", bias=False, expand=expand)
    if fisher == "mc":
        kwargs["mc_samples"] = 3
    got, twin = (gradhooks.kfac(m, x, y, generator=torch.Generator().manual_seed(7),
                                **kwargs)["first.weight"] for m in (conv, linear))  # fmt: skip
    assert_close(torch.kron(got.A, got.G), torch.kron(twin.G, twin.A), "kron products")


def toy_model() -> tuple[Tensor, SimpleMLP]:
    """autograd-lib's ``create_toy_model``: ``SimpleMLP([2, 2, 2])`` without bias, weights
    ``X`` and ``Bᵀ``, and its data ``A``."""
    model = SimpleMLP([2, 2, 2], bias=False).to(D)
    a = torch.tensor([[-1.0, 4], [3, 0]], dtype=D)
    b = torch.tensor([[-4.0, 3], [2, 6]], dtype=D)
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.tensor([[-5.0, 0], [-2, -6]], dtype=D))
        model.layers[1].weight.copy_(b.t())
    return a, model


def test_autograd_lib_jacobian_squared_is_least_squares_hessian():
    """``test_jacobian_full``: the toy network on its data repeated three times; the squared
    Jacobian of the output with respect to the first weight, ``Σ_n J_nᵀ J_n``, from
    gradhooks' per-example Jacobians (autograd-lib backpropagates each row of the identity,
    ``backward_jacobian``; here ``backprop_hess(out, "LeastSquares")`` and ``compute_hess``,
    which is the same sum over ``n``) is autograd's ``noij,nokl->ijkl`` contraction and the
    Hessian of the summed least-squares loss."""
    a, model = toy_model()
    data = a.t().repeat(3, 1)
    j = gradhooks.jacobians(model, data)["layers.0.weight"]  # [n, o, 2, 2]
    got = torch.einsum("noij,nokl->ijkl", j, j).reshape(4, 4)
    w = model.layers[0].weight
    jac_autograd = torch.autograd.functional.jacobian(
        lambda v: with_param(model, "layers.0.weight", v, data), w.detach().clone()
    )
    assert_close(got, torch.einsum("noij,nokl->ijkl", jac_autograd, jac_autograd).reshape(4, 4),
                 "squared Jacobian against autograd's")  # fmt: skip
    lsq = hessian_of(lambda v: 0.5 * with_param(model, "layers.0.weight", v, data).pow(2).sum(), w)
    assert_close(got, lsq, "squared Jacobian against the least-squares Hessian")
    with gradhooks.add_hooks(model):
        gradhooks.backprop_hess(model(data), "LeastSquares")
        gradhooks.compute_hess(model)
    assert_close(w.hess * len(data), lsq, "compute_hess (a mean over examples) times n")


def test_autograd_lib_fisher_one_example_at_a_time():
    """``test_fisher_full``: the toy network fed its two examples one at a time, ``loss =
    Σ y² / 2`` and a backward each under the hooks; the empirical Fisher ``Σ_n vec(g_n)
    vec(g_n)ᵀ`` of the first weight from each step's ``grad1`` (``[1, 2, 2]``) is the
    per-example loop's (the peer compares with numbers it wrote down). The peer gives each
    example unbatched, a vector of 2 that ``SimpleMLP`` reshapes to one row: gradhooks takes a
    model's first input's dimension 0 as the batch, two examples of one number each, which the
    reshape puts into one row; refused, naming the layer and the input, with the remedy for an
    example given alone (``x.unsqueeze(0)``), which then runs the peer's loop."""
    a, model = toy_model()
    w = model.layers[0].weight
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        raised(gradhooks.MixedExamplesError, ["'layers.1'", "1-d ((2,))", "x.unsqueeze(0)"],
               lambda: model(a.t()[0]))  # fmt: skip
    fisher = torch.zeros(4, 4, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for x in a.t():
            model.zero_grad()
            y = model(x.unsqueeze(0))
            (torch.sum(y * y) / 2).backward()
            assert w.grad1.shape == (1, 2, 2)
            g = w.grad1.reshape(1, 4)
            fisher += g.T @ g
    want = loop_grad(model, lambda out, t=None: 0.5 * out.pow(2).sum(), a.t().contiguous())
    g = want["layers.0.weight"].reshape(2, 4)
    assert_close(fisher, g.T @ g, "empirical Fisher against the loop")


def test_autograd_lib_example_norms():
    """``example_norms.py`` (its README's first example): a deep linear network of five
    identity 2x2 layers, three examples of ones, ``Σ err² / 2 / n``; the per-example squared
    gradient norms by Goodfellow's trick ``Σ_layers |A|²·|B|²`` (``B`` the backprops of the
    mean loss, ``1/n`` of each example's own) are ``h.norms()²`` over ``n²``, and the loop's.
    Then on random data and weights, where the examples differ."""
    for seed in (None, 0):
        torch.manual_seed(seed or 0)
        model = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in range(5)]).to(D)
        data = torch.randn(3, 2, dtype=D)
        if seed is None:  # (the peer's: identity layers, examples of ones)
            with torch.no_grad():
                for layer in model:
                    layer.weight.copy_(torch.eye(2, dtype=D))
            data = torch.ones(3, 2, dtype=D)
        acts, b, peer = {}, {}, torch.zeros(3, dtype=D)

        def save(m, args, out, acts=acts, b=b):  # (autograd-lib's activations, backprops)
            acts[m] = args[0].detach()
            out.register_hook(lambda g, m=m: b.__setitem__(m, g.detach()))

        hooks = [m.register_forward_hook(save) for m in model]
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            out = model(data)
            (torch.sum(out * out) / 2 / len(data)).backward()
            norms = h.norms()
        for handle in hooks:
            handle.remove()
        for m in model:
            peer += (acts[m] ** 2).sum(1) * (b[m] ** 2).sum(1)
        want = loop_grad(model, lambda o, t=None: 0.5 * (o * o).sum(), data)
        assert_close(norms**2, flat_grads(want).pow(2).sum(1), f"seed {seed}: against the loop")
        assert_close(norms**2 / len(data) ** 2, peer, f"seed {seed}: the peer's Σ |A|²|B|²")


# == bergson: tests/test_gradients.py ===========================================================

N, S, IN, OUT = 4, 6, 5, 3  # bergson's test_params (N, S, I, O)


class SimpleModel(nn.Module):
    """bergson's ``simple_model_class``: ``fc`` alone, or ``fc1`` - ReLU - ``fc2``."""

    def __init__(self, include_bias: bool, num_layers: int = 2):
        super().__init__()
        if num_layers == 1:
            self.fc = nn.Linear(IN, OUT, bias=include_bias)
            self.layers = nn.Sequential(self.fc)
        else:
            self.fc1 = nn.Linear(IN, OUT * 2, bias=include_bias)
            self.relu = nn.ReLU()
            self.fc2 = nn.Linear(OUT * 2, OUT, bias=include_bias)
            self.layers = nn.Sequential(self.fc1, self.relu, self.fc2)

    def forward(self, x):
        return self.layers(x)


def adam_trained(include_bias: bool):
    """bergson's ``trained_model_with_normalizers``: five Adam steps on ``(out**2).sum()`` of
    random ``[N, S, I]`` batches, then each parameter's ``exp_avg_sq``."""
    torch.manual_seed(42)
    model = SimpleModel(include_bias).to(D)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    for _ in range(5):
        opt.zero_grad()
        (model(torch.randn(N, S, IN, dtype=D)) ** 2).sum().backward()
        opt.step()
    moments = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return model, moments


def adam_normalize(grad: Tensor, avg_sq: Tensor, eps: float = 1e-8) -> Tensor:
    """bergson's ``AdamNormalizer.normalize_weight`` / ``normalize_bias``: ``g / (√v + ε)``."""
    return grad / (avg_sq.sqrt() + eps)


def adafactor_normalize(grad: Tensor, row: Tensor, col: Tensor, eps: float = 1e-30) -> Tensor:
    """bergson's ``AdafactorNormalizer.normalize_weight``: ``g · √mean(r)/√r ⊗ 1/√c``."""
    r, c = row + eps, col + eps
    return grad * (r.mean().sqrt() * r.rsqrt())[..., :, None] * c.rsqrt()[..., None, :]


def per_sequence_loop(model: nn.Module, x: Tensor, loss_of) -> dict[str, Tensor]:
    """bergson's ground truth: one forward, then ``per_sample_losses[n].backward(retain_graph
    =True)`` for each ``n``, each parameter's ``.grad`` read."""
    out = model(x)
    losses = loss_of(out)
    rows: dict[str, list[Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for n in range(len(losses)):
        model.zero_grad(set_to_none=True)
        losses[n].backward(retain_graph=True)
        for name, p in model.named_parameters():
            rows[name].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {name: torch.stack(r) for name, r in rows.items()}


def with_bias_column(grads: dict[str, Tensor], layer: str, bias: bool) -> Tensor:
    """bergson's flattened ``[N, O·(I+1)]`` layout: the bias as a last column."""
    w = grads[f"{layer}.weight"]
    if bias:
        w = torch.cat([w, grads[f"{layer}.bias"][..., None]], -1)
    return w.flatten(1)


@pytest.mark.parametrize("include_bias", [True, False], ids=["bias", "no-bias"])
def test_bergson_gradient_collector_batched(include_bias):
    """``test_gradient_collector_batched``: the Adam-trained two-layer model on ``[4, 6, 5]``
    under ``(out**2).sum()``; each layer's ``grad1`` divided by ``√exp_avg_sq + 1e-8``, the
    bias (normalized by its own moments) a last column, is the loop's of each sequence's
    ``(output**2).sum(dim=(1, 2))``."""
    model, moments = adam_trained(include_bias)
    x = torch.randn(N, S, IN, dtype=D)
    want = per_sequence_loop(model, x, lambda out: (out**2).sum(dim=(1, 2)))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (model(x) ** 2).sum().backward()
    got = grad1_of(model)
    for name in ("fc1", "fc2"):
        got_n = {k: adam_normalize(got[k], moments[k]) for k in got if k.startswith(name)}
        want_n = {k: adam_normalize(want[k], moments[k]) for k in want if k.startswith(name)}
        assert got_n and want_n.keys() == got_n.keys()
        assert_close(
            with_bias_column(got_n, name, include_bias),
            with_bias_column(want_n, name, include_bias),
            f"{name}: Adam-normalized",
        )


def test_bergson_bias_gradients():
    """``test_bias_gradients``: ``fc`` alone on ``[4, 6, 5]``; the bias column of the
    ``[N, O, I + 1]`` per-example gradient is the loop's bias gradient, each sequence's sum
    over its positions."""
    model = seeded(lambda: SimpleModel(True, num_layers=1), 42).to(D)
    x = torch.randn(N, S, IN, dtype=D)
    want = per_sequence_loop(model, x, lambda out: (out**2).sum(dim=(1, 2)))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (model(x) ** 2).sum().backward()
    collected = with_bias_column(grad1_of(model), "fc", True).reshape(N, OUT, IN + 1)
    assert collected[..., -1].shape == (N, OUT)
    assert_close(collected[..., -1], want["fc.bias"], "the bias column")
    assert_close(collected[..., :-1], want["fc.weight"], "the weight")


def test_bergson_adafactor_normalization_ground_truth():
    """``test_adafactor_normalization_ground_truth``: the Adam moments factored as Adafactor's
    (``to_adafactor``: row and column means), each ``grad1`` scaled by ``√mean(r)/√r`` per row
    and ``1/√c`` per column, the bias by ``1/√(v_b + 1e-30)``; the loop's scaled the same."""
    model, moments = adam_trained(True)
    x = torch.randn(N, S, IN, dtype=D)
    want = per_sequence_loop(model, x, lambda out: (out**2).sum(dim=(1, 2)))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (model(x) ** 2).sum().backward()
    got = grad1_of(model)
    for name in ("fc1", "fc2"):
        v, vb = moments[f"{name}.weight"], moments[f"{name}.bias"]
        row, col = v.mean(1), v.mean(0)

        def normalized(g, name=name, row=row, col=col, vb=vb):
            w = adafactor_normalize(g[f"{name}.weight"], row, col)
            b = g[f"{name}.bias"] * (vb + 1e-30).rsqrt()
            return torch.cat([w, b[..., None]], -1).flatten(1)

        assert_close(normalized(got), normalized(want), f"{name}: Adafactor-normalized")


@pytest.mark.parametrize("normalizer", ["none", "adafactor"])
def test_bergson_projected_bias_gradients_match_full_projection(normalizer):
    """``test_projected_bias_gradients_match_full_projection``: projected to ``P = 4`` on both
    sides, ``L [G | b] Rᵀ`` (``L`` ``[4, O]``, ``R`` ``[4, I + 1]``) of each example's
    gradient, bergson's factored form (``(L gᵀ)`` and ``(R [a | 1]ᵀ)`` per position, summed
    over positions) against the same projection of ``grad1``; the peer uses a batch of one
    so that ``.grad`` is the example's, here a batch of four against the loop."""
    model = seeded(lambda: SimpleModel(True), 0).to(D)
    x = torch.randn(N, S, IN, dtype=D)
    want = per_sequence_loop(model, x, lambda out: (out**2).sum(dim=(1, 2)))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (model(x) ** 2).sum().backward()
    got = grad1_of(model)
    g = torch.Generator().manual_seed(3)
    for name in ("fc1", "fc2"):
        layer = getattr(model, name)
        o, i = layer.out_features, layer.in_features
        row, col, vb = (torch.rand(n, generator=g, dtype=D) + 0.1 for n in (o, i, o))

        def full(grads, name=name, row=row, col=col, vb=vb):
            w, b = grads[f"{name}.weight"], grads[f"{name}.bias"]
            if normalizer == "adafactor":
                w = adafactor_normalize(w, row, col)
                b = b * (vb + 1e-8).rsqrt()
            return torch.cat([w, b[..., None]], -1)  # [N, OUT, IN + 1]

        left = torch.randn(4, o, generator=g, dtype=D)
        right = torch.randn(4, i + 1, generator=g, dtype=D)
        projected = left @ full(got) @ right.T
        assert_close(projected, left @ full(want) @ right.T, f"{name}: L [G | b] Rᵀ")


class TwoLayerModel(nn.Module):
    """bergson's ``_TwoLayerModel``: a layer with a bias feeding one without."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("normalizer", ["none", "adam", "adafactor"])
def test_bergson_module_gradients_match_autograd(normalizer):
    """``test_module_gradients_match_autograd``: ``x`` ``[2, 4, 4]`` whose second sequence is
    padding after its second position, the loss ``(model(x).pow(2).sum(-1) * mask).sum()``:
    each sequence's ``grad1`` (normalized) is the sum of autograd's gradients of its collected
    positions' losses; split into two heads of 3 rows (``AttentionConfig(num_heads=2,
    head_size=3)`` on ``up``), each head's rows are the sum's rows; and per token
    (``attribute_tokens``: the collected positions as the examples of a position-wise call),
    ``grad1`` is autograd's per position."""
    model = seeded(TwoLayerModel).to(D)
    x = torch.randn(2, 4, 4, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    moments = {n: torch.rand(p.shape, generator=g, dtype=D) + 0.5 for n, p in
               model.named_parameters()}  # fmt: skip

    def normalize(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        if normalizer == "adam":
            return {n: adam_normalize(t, moments[n]) for n, t in grads.items()}
        if normalizer == "adafactor":
            out = {}
            for n, t in grads.items():
                v = moments[n]
                out[n] = (adafactor_normalize(t, v.mean(1), v.mean(0)) if t.dim() == 3
                          else t * (v + 1e-8).rsqrt())  # fmt: skip
            return out
        return grads

    rows: dict[tuple[int, int], dict[str, Tensor]] = {}
    for n, s in mask.nonzero().tolist():
        model.zero_grad(set_to_none=True)
        model(x)[n, s].pow(2).sum().backward()
        rows[n, s] = {name: p.grad[None].clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (model(x).pow(2).sum(-1) * mask).sum().backward()
    got = normalize(grad1_of(model))
    for name in got:
        want = torch.cat([sum(r[name] for (n, _), r in rows.items() if n == seq)
                          for seq in range(2)])  # fmt: skip
        want = normalize({name: want})[name]
        assert_close(got[name], want, f"{normalizer}, per sequence: {name}")
        if name.startswith("up."):
            for head in range(2):
                assert_close(got[name][:, 3 * head : 3 * head + 3],
                             want[:, 3 * head : 3 * head + 3], f"{name}, head {head}")  # fmt: skip

    model.zero_grad(set_to_none=True)
    tokens = x[mask]  # [T, 4]
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(tokens).pow(2).sum().backward()
    got = normalize(grad1_of(model))
    for name in got:
        want = normalize({name: torch.cat([r[name] for r in rows.values()])})[name]
        assert_close(got[name], want, f"{normalizer}, per token: {name}")


def test_bergson_model_left_as_it_was_after_hooked_batches():
    """``test_in_features_restored_after_collector`` (and Opacus' ``test_model_not_modified``):
    three hooked batches leave every Linear's ``in_features``, every module's attributes, the
    parameters, the state dict and the outputs as they were, and no hook behind."""
    model = seeded(lambda: SimpleModel(True)).to(D)
    x = torch.randn(N, S, IN, dtype=D)
    with torch.no_grad():
        before_out = model(x)
    in_features = {n: m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    attrs = {n: sorted(vars(m)) for n, m in model.named_modules()}
    hooks = {n: [len(getattr(m, k)) for k in ("_forward_hooks", "_forward_pre_hooks",
             "_backward_hooks", "_backward_pre_hooks")] for n, m in model.named_modules()}  # fmt: skip
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            model.zero_grad()
            (model(x) ** 2).sum().backward()
    assert {n: m.in_features for n, m in model.named_modules()
            if isinstance(m, nn.Linear)} == in_features  # fmt: skip
    assert {n: sorted(vars(m)) for n, m in model.named_modules()} == attrs
    assert {n: [len(getattr(m, k)) for k in ("_forward_hooks", "_forward_pre_hooks",
            "_backward_hooks", "_backward_pre_hooks")] for n, m in model.named_modules()} == hooks  # fmt: skip
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(model(x), before_out)


# == bergson: tests/test_outer_product_gradients.py, test_batch_size_invariance.py ==============

SEQUENCES = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]  # bergson's DATA


def tiny_neox():
    """A tiny GPT-NeoX (``trl-internal-testing/tiny-GPTNeoXForCausalLM``'s kind, built here)
    in float64, eager attention, with ``layers[0].attention.dense.bias = None`` as the peer
    sets it."""
    cfg = hf("GPTNeoXConfig")(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        vocab_size=20, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf("GPTNeoXForCausalLM")(cfg).to(D).eval()
    model.gpt_neox.layers[0].attention.dense.bias = None
    return model


class SummedLM(nn.Module):
    """bergson's per-sequence loss: the summed next-token cross-entropy of each sequence's real
    positions (labels ``-100`` at padding), as one output ``[batch]``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        logits = self.model(input_ids=ids, attention_mask=attention_mask).logits
        labels = ids.masked_fill(attention_mask == 0, -100)[:, 1:]
        ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
        return ce.sum(1)


def padded(sequences):
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def alone(model: nn.Module, sequences) -> dict[str, Tensor]:
    """Each sequence's gradient, computed on it alone (unpadded)."""
    rows: dict[str, list[Tensor]] = {n: [] for n, p in model.named_parameters()}
    for s in sequences:
        ids = torch.tensor([s])
        model.zero_grad(set_to_none=True)
        model(ids, torch.ones_like(ids)).sum().backward()
        for n, p in model.named_parameters():
            rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(r) for n, r in rows.items()}


def test_bergson_outer_product_norms_and_dots_of_a_padded_batch():
    """``test_sq_norm_matches_formed_gradients`` and ``test_dot_matches_formed_gradients`` on
    its tiny GPT-NeoX (a dense layer without bias) over its three sequences of 6, 3 and 4
    tokens, right-padded into one batch: ``grad1`` of every parameter is each sequence's
    gradient computed alone; the per-parameter norms (``quantities=("norms",)``, formed
    without ``grad1``) are the formed gradients'; the dot products with random queries, whole
    and over column ranges that start and end within a row, are the formed gradients'; and
    the fused ``query_key_value`` weight split into its heads' rows (``AttentionConfig``)
    agrees head by head."""
    model = SummedLM(tiny_neox())
    ids, mask = padded(SEQUENCES)
    want = alone(model, SEQUENCES)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(ids, mask).sum().backward()
    got = grad1_of(model)
    for name, g in got.items():
        assert_close(g, want[name], f"padded batch against each alone: {name}")
    gradhooks.clear_grad1(model)
    model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        model(ids, mask).sum().backward()
        norms = h.param_norms()
    for name, g in want.items():
        if g.abs().sum() == 0:  # (a parameter no sequence reaches)
            continue
        assert_close(norms[name], g.flatten(1).norm(dim=1), f"norm of {name}")
    gen = torch.Generator().manual_seed(0)
    for name, g in got.items():
        formed = g.flatten(1)
        n = formed.shape[1]
        for start, stop in [(0, n), (1, n - 2), (n // 3, n // 3 + 5)]:
            q = torch.randn(3, stop - start, generator=gen, dtype=D)
            assert_close(formed[:, start:stop] @ q.T, want[name].flatten(1)[:, start:stop] @ q.T,
                         f"dot of {name}[{start}:{stop}]")  # fmt: skip
    qkv = "model.gpt_neox.layers.0.attention.query_key_value.weight"
    heads = got[qkv].reshape(3, 4, 3 * 4, 16)  # [n, heads, 3 · head_size, hidden]
    assert_close(heads, want[qkv].reshape(3, 4, 12, 16), "query_key_value by head")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bergson_gradients_do_not_depend_on_the_batching(reduction):
    """``test_gradient_scale_invariance``: the same sequences taken as two batches (of 2 and
    3) and as one combined batch of 5 give each sequence the same gradient, under a batch loss
    that is a mean (the peer's bug: ``loss.mean().backward()`` scaled them by the batch size)
    or a sum."""
    model = SummedLM(tiny_neox())
    sequences = SEQUENCES + [[2, 4, 6, 8], [3, 5, 7, 9, 11]]

    def grads_of(seqs):
        ids, mask = padded(seqs)
        model.zero_grad(set_to_none=True)
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            losses = model(ids, mask)
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
        got = flat_grads(grad1_of(model))
        gradhooks.clear_grad1(model)
        return got

    separate = torch.cat([grads_of(sequences[:2]), grads_of(sequences[2:])])
    combined = grads_of(sequences)
    assert_close(combined, separate, "combined batch against separate batches")
    assert torch.isclose(combined.std(), separate.std(), rtol=1e-7)


# == bergson: tests/test_moe.py ==================================================================

SEQ_LEN = 7
MOE_SHARED = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=24, max_position_embeddings=32,
                  num_experts_per_tok=2)  # fmt: skip


def moe_model(family: str, dtype: torch.dtype = D) -> nn.Module:
    """bergson's ``build_model`` / ``_other_family_config``, smaller: one layer of four
    experts, two per token. In float64 the experts run transformers' eager kernel (its
    default, grouped matrix products, takes no float64 on the CPU)."""
    if family == "gpt_oss":
        cfg = hf("GptOssConfig")(head_dim=8, intermediate_size=8, num_local_experts=4,
                                 **MOE_SHARED)  # fmt: skip
    elif family == "mixtral":
        cfg = hf("MixtralConfig")(intermediate_size=8, num_local_experts=4, **MOE_SHARED)
    elif family == "olmoe":
        cfg = hf("OlmoeConfig")(intermediate_size=8, num_experts=4, **MOE_SHARED)
    elif family == "qwen3_moe":
        cfg = hf("Qwen3MoeConfig")(intermediate_size=8, moe_intermediate_size=8, num_experts=4,
                                   head_dim=8, **MOE_SHARED)  # fmt: skip
    else:  # deepseek_v3: a sigmoid, grouped top-k router with a score-correction bias
        shared = {k: v for k, v in MOE_SHARED.items() if k != "num_key_value_heads"}
        cfg = hf("DeepseekV3Config")(
            intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4, n_group=1,
            topk_group=1, first_k_dense_replace=0, n_shared_experts=1, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, kv_lora_rank=4, q_lora_rank=4,
            num_key_value_heads=2, **shared,
        )  # fmt: skip
    if dtype == D:
        cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return hf("AutoModelForCausalLM").from_config(cfg).to(dtype).eval()


class LogitsOf(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def squared_logits(out, target=None):
    return (out**2).sum()


def expert_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()
            if ".experts." in n or n.rsplit(".", 2)[-2] in ("gate", "router")]  # fmt: skip


@pytest.mark.parametrize(
    "family,batch",
    [("gpt_oss", 1), ("gpt_oss", 3), ("mixtral", 3), ("olmoe", 2), ("qwen3_moe", 2),
     ("deepseek_v3", 2)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_bergson_moe_per_example_gradients_match_autograd(family, batch):
    """``test_per_example_gradients_match_autograd`` / ``test_other_families_match_autograd``:
    ``(logits**2).sum()`` of random token ids ``[batch, 7]``; every parameter's ``grad1``
    (the fused experts' ``[experts, ...]`` weights and biases, whatever expert got no token,
    the routers) is the loop's, and not all zero."""
    model = LogitsOf(moe_model(family))
    ids = torch.randint(0, 24, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    names = expert_names(model)
    assert names, "no expert or router parameter"
    want = loop_grad(model, squared_logits, ids)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        squared_logits(model(ids)).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"{family}: {name}")
    assert max(model.get_parameter(n).grad1.abs().max() for n in names) > 0


def test_bergson_moe_float32_default_experts_kernel():
    """The peer's own precision: gpt-oss in float32 with transformers' default experts kernel
    (not the eager one), ``grad1`` of the experts and the router against the float64 loop at
    float32's tolerance."""
    model = LogitsOf(moe_model("gpt_oss", torch.float32))
    ref = LogitsOf(moe_model("gpt_oss", torch.float32)).to(D)
    ref.model.config._experts_implementation = "eager"
    ids = torch.randint(0, 24, (3, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    want = loop_grad(ref, squared_logits, ids)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        squared_logits(model(ids)).backward()
    for name in expert_names(model):
        got = model.get_parameter(name).grad1.double()
        scale = want[name].abs().max()
        torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-4 * float(scale),
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_bergson_moe_norms_and_hooks_transparent(family):
    """``test_expansion_is_transparent_and_reversible`` and ``test_projection_shapes_and_
    determinism``: under the hooks the logits, the parameters' names, the state dict and the
    modules are as without them, and after removal no hook is left; two backwards give the
    same per-example gradients; the per-example norms of the experts and routers
    (``quantities=("norms",)``) are the loop's gradients' norms."""
    model = LogitsOf(moe_model(family))
    ids = torch.randint(0, 24, (3, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids).clone()
    params, state = [n for n, _ in model.named_parameters()], set(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    want = loop_grad(model, squared_logits, ids)
    grads = []
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for _ in range(2):
            model.zero_grad()
            out = model(ids)
            assert torch.equal(out, reference)
            squared_logits(out).backward()
            grads.append({n: model.get_parameter(n).grad1.clone() for n in expert_names(model)})
            norms = h.param_norms()
        assert [n for n, _ in model.named_parameters()] == params
        assert set(model.state_dict()) == state and [n for n, _ in model.named_modules()] == modules
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    for name in expert_names(model):
        assert torch.equal(grads[0][name], grads[1][name]), name
        assert_close(norms[name], want[name].flatten(1).norm(dim=1), f"{family}: norm of {name}")


# == bergson: tests/ekfac_tests/test_conv1d_covariance.py, test_shared_inputs.py ================


class TinyConv1DModel(nn.Module):
    """bergson's ``TinyConv1DModel``: Hugging Face's ``Conv1D(nf=6, nx=4)`` (a weight
    ``[in, out]``, ``torch.addmm(b, x, W)``) and a Linear back to 4, a tanh between (the peer
    has none)."""

    def __init__(self):
        super().__init__()
        conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
        self.conv = conv1d(6, 4)
        self.linear = nn.Linear(6, 4)

    def forward(self, x, mask):
        # (the padding's outputs out of the loss, as a collator's labels of -100 leave them)
        return self.linear(torch.tanh(self.conv(x))) * mask[..., None]


def by_hand_of_each_sequence(model: TinyConv1DModel, x: Tensor, mask: Tensor, v: Tensor):
    """The factors as the sequences unpadded, each run alone, give them (expanded, summed over
    examples), for the output-gradient ``v`` (``[batch, positions, 4]``, as padded): the
    Conv1D's ``G`` over its inputs ``Σ a aᵀ`` and ``A`` over its output-gradients
    ``Σ g gᵀ / positions``; the Linear's ``A`` of ``[a | 1]`` over the positions and ``G`` of
    ``v``."""
    ins, outs, acts, gl = [], [], [], []
    for i in range(len(x)):
        xi, vi = x[i, mask[i]], v[i, mask[i]]
        h = model.conv(xi)
        t = torch.tanh(h)
        (gh,) = torch.autograd.grad(model.linear(t), h, vi)
        ins.append(xi)
        outs.append(gh)
        acts.append(torch.cat([t.detach(), torch.ones(len(t), 1, dtype=D)], 1))
        gl.append(vi)
    a, ga, al, gg = (torch.cat(t) for t in (ins, outs, acts, gl))
    positions = int(mask.sum())
    return {"conv.G": a.T @ a, "conv.A": ga.T @ ga / positions,
            "linear.A": al.T @ al / positions, "linear.G": gg.T @ gg}  # fmt: skip


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_bergson_kfac_of_a_conv1d_over_real_positions(fisher, padded):
    """``test_covariance_collector_on_conv1d``: the covariance of the inputs of a Conv1D over
    the valid positions is ``x[mask]ᵀ x[mask]`` (``[in, in]``) and that of its
    output-gradients ``[out, out]``; in gradhooks' K-FAC of a weight ``[in, out]`` they are
    ``G`` and ``A``. With padding (the peer's mask is all ones; a tokenizer's is not), the
    factors of ``kfac(mask=...)`` are those of the sequences unpadded: the padding's inputs
    (never zero, unlike its output-gradients) leave the Conv1D's ``G``, also where ``G`` is
    formed from several backwards at once (``"mc"`` with three samples of given
    output-gradients, batched by ``vmap``). ``"empirical"``: the peer's ``out.sum()``."""
    model = seeded(TinyConv1DModel).to(D)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=D, generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    if padded:
        mask[1, 2:], mask[2, 3:] = False, False
    v = torch.randn(3, 4, 4, dtype=D, generator=g) * mask[..., None]
    if fisher == "empirical":
        v = torch.ones(3, 4, 4, dtype=D) * mask[..., None]
        f = gradhooks.kfac(model, (x, mask), fisher="empirical", loss=lambda out: out.sum(),
                           reduction="sum", mask=mask)  # fmt: skip
    else:
        f = gradhooks.kfac(model, (x, mask), fisher="mc", output_grads=lambda out, gen: v,
                           mc_samples=3, reduction="sum", mask=mask)  # fmt: skip
    want = by_hand_of_each_sequence(model, x, mask, v)
    conv, linear = f["conv.weight"], f["linear.weight"]
    assert conv.G.shape == (4, 4) and conv.A.shape == (6, 6) and not conv.bias
    assert_close(conv.G, want["conv.G"], "Conv1D: G, the inputs' Σ a aᵀ over real positions")
    assert_close(conv.A, want["conv.A"], "Conv1D: A, the output-gradients'")
    assert_close(linear.A, want["linear.A"], "Linear: A")
    assert_close(linear.G, want["linear.G"], "Linear: G")


class SharedInputs(nn.Module):
    """bergson's ``ToyModel`` (``test_shared_inputs.py``): ``q``, ``k``, ``v``, a biased
    Linear and one behind a dropout read the same normalized embedding; ``twice`` is called
    twice; ``out`` reads their sum."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 6)
        self.norm = nn.LayerNorm(6)
        self.q, self.k, self.v = (nn.Linear(6, 6, bias=False) for _ in range(3))
        self.biased = nn.Linear(6, 6)
        self.dropped = nn.Linear(6, 6, bias=False)
        self.dropout = nn.Dropout(0.5)
        self.twice = nn.Linear(6, 6, bias=False)
        self.out = nn.Linear(6, 6, bias=False)

    def forward(self, x):
        h = self.norm(self.embed(x))
        return self.out(self.q(h) + self.k(h) + self.v(h) + self.biased(h)
                        + self.dropped(self.dropout(h)) + self.twice(self.twice(h)))  # fmt: skip


def test_bergson_kfac_modules_reading_one_input():
    """``test_find_shared_inputs`` / ``test_sharing_matches_separate_fits`` (in eval, the
    dropout passing its input): the modules that read one input have the same ``A`` (the
    biased one's, bias-augmented, holds it as its ``[:6, :6]`` block; ``bias=False`` makes it
    the same), each equal to the definition ``Σ a aᵀ / positions`` over the tokens; the module
    called twice has the ``A`` of both calls' inputs over both calls' rows and the ``G`` of
    both calls' output-gradients; ``G`` of each is its own output-gradients' (``fisher=
    "empirical"``, ``loss = ½ Σ out²``)."""
    model = seeded(SharedInputs).to(D).eval()
    ids = torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(0))
    loss = lambda out: 0.5 * out.pow(2).sum()  # noqa: E731
    f = gradhooks.kfac(model, ids, fisher="empirical", loss=loss, reduction="sum")
    plain = gradhooks.kfac(model, ids, fisher="empirical", loss=loss, reduction="sum", bias=False)
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def keep(name):
        def hook(module, args, out):
            a = args[0].detach().reshape(-1, 6)
            out.register_hook(lambda g: seen[name].append((a, g.reshape(-1, 6))))
            seen.setdefault(name, [])

        return hook

    handles = [getattr(model, n).register_forward_hook(keep(n))
               for n in ("q", "k", "v", "biased", "dropped", "twice", "out")]  # fmt: skip
    loss(model(ids)).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    for name, calls in seen.items():
        a = torch.cat([c[0] for c in calls])
        g = torch.cat([c[1] for c in calls])
        got = plain[f"{name}.weight"]
        assert_close(got.A, a.T @ a / len(a), f"{name}: A")
        assert_close(got.G, g.T @ g, f"{name}: G")
    for name in ("k", "v", "dropped"):
        assert torch.equal(f[f"{name}.weight"].A, f["q.weight"].A), name
    assert f["biased.weight"].bias and f["biased.weight"].A.shape == (7, 7)
    assert_close(f["biased.weight"].A[:6, :6], f["q.weight"].A, "biased: its inputs' block")
    assert len(seen["twice"]) == 2


# == bergson: tests/ekfac_tests/test_sampled_fisher_mask.py =====================================


def test_bergson_sampled_labels_only_add_loss_where_dataset_labels_do():
    """``test_sampled_labels_only_add_loss_where_dataset_labels_do``: two sequences of 8 and 4
    tokens right-padded, labelled ``-100`` on a prompt of three tokens, on the first position
    of the second and on the padding (the peer's dataset); with every sampled label the true
    next token (the peer's ``torch.multinomial`` returning it), ``kfac(fisher="mc")`` given the
    labels is ``kfac(fisher="empirical")``: sampling adds no loss where the labels have none.
    The default sampler, given the labels, leaves those positions out too: its factors are
    those of the padded batch whose prompt and padding logits are anything else. And
    ``"exact"``: an example labelled ``-100`` adds nothing to ``G``."""
    model = Logits(tiny_neox(), last=False)
    ids, mask = padded([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]])
    labels = torch.full_like(ids, -100)
    labels[0, 2:7] = ids[0, 3:8]  # (position t predicts token t + 1; the first 3 a prompt)
    labels[1, 1:3] = ids[1, 2:4]
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # (each position's next input token)
    kwargs = dict(kwargs={"attention_mask": mask}, reduction="sum", mask=mask)
    sampled = gradhooks.kfac(model, ids, labels, fisher="mc",
                             sample_target=lambda out, gen: nxt, **kwargs)  # fmt: skip
    true = gradhooks.kfac(model, ids, labels, fisher="empirical", **kwargs)
    assert sampled.keys() == true.keys()
    for name, f in true.items():
        assert_close(sampled[name].A, f.A, f"{name}: A")
        assert_close(sampled[name].G, f.G, f"{name}: G")
    head = "model.lm_head.weight"
    got = gradhooks.kfac(model, ids, labels, fisher="mc", mc_samples=2,
                         generator=torch.Generator().manual_seed(0), **kwargs)[head]  # fmt: skip
    with torch.no_grad():  # (the same draws: one label per position, sample after sample)
        probs = model(ids, mask).softmax(-1).flatten(0, 1)
    gen, kept, want = torch.Generator().manual_seed(0), (labels != -100).flatten(), 0
    for _ in range(2):
        y = torch.multinomial(probs, 1, generator=gen)[:, 0]
        v = (probs - F.one_hot(y, probs.shape[1]).to(D))[kept]
        want = want + v.T @ v / 2
    assert_close(got.G, want, "the default sampler: G of the head over the labelled positions")

    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).to(D)
    x = torch.randn(3, 3, dtype=D)
    y = torch.tensor([1, -100, 2])
    with_ignored = gradhooks.kfac(mlp, x, y, fisher="exact", reduction="sum")
    without = gradhooks.kfac(mlp, x[[0, 2]], y[[0, 2]], fisher="exact", reduction="sum")
    for name, f in without.items():
        assert_close(with_ignored[name].G, f.G, f"exact, {name}: G without the ignored example")


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_bergson_moe_kfac_of_the_router_and_the_fused_experts(family):
    """``test_ekfac_covariance_over_experts``: bergson factors each expert over the rows routed
    to it; gradhooks' K-FAC has no factors for the fused ``[experts, ...]`` weights (no rule
    reads an expert's inputs and output-gradients), leaves them out and says so, naming them,
    with a ``GradhooksWarning``; the router, a Linear, has the factors of its definition:
    ``A`` over every token's input (bias-augmented where it has one), ``G`` of its
    output-gradients under the summed cross-entropy of the next tokens (``"empirical"``)."""
    model = LogitsOf(moe_model(family))
    ids = torch.randint(0, 24, (2, SEQ_LEN), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with pytest.warns(gradhooks.GradhooksWarning, match=r"no Kronecker factors for .*experts"):
        f = gradhooks.kfac(model, ids, labels, fisher="empirical", reduction="sum")
    assert not any(".experts." in name for name in f)
    router_name = next(
        n for n in expert_names(model) if n.endswith(("gate.weight", "router.weight"))
    )
    router = model.get_submodule(router_name.rsplit(".", 1)[0])
    seen = {}

    def keep(module, args, out):
        seen["a"] = args[0].detach().reshape(-1, args[0].shape[-1])
        logits = out[0] if isinstance(out, tuple) else out  # (its F.linear's output: the
        # routers return (logits, scores, indices), the scores computed from the logits)
        logits.register_hook(lambda g: seen.__setitem__("g", g.reshape(-1, g.shape[-1])))

    handle = router.register_forward_hook(keep)
    out = model(ids)
    F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    a, bias = seen["a"], getattr(router, "bias", None)
    if bias is not None:
        a = torch.cat([a, torch.ones(len(a), 1, dtype=D)], 1)
    got = f[router_name]
    assert got.bias == (bias is not None)
    assert_close(got.A, a.T @ a / len(a), f"{family}: the router's A")
    assert_close(got.G, seen["g"].T @ seen["g"], f"{family}: the router's G")


# == ASDL: tests/test_param_grad_w_fisher_emp.py, tests/test_shape_selection_in_ngd.py ===========


def asdl_convnet(n_dim: int = 32, n_channels: int = 4, n_classes: int = 10, kernel_size: int = 3):
    """ASDL's ``convnet`` (its tests use 16 channels): two convolutions each followed by a
    max-pool of its kernel size and a ReLU, then a Linear."""
    n_features = int(n_dim / (2**4)) ** 2 * n_channels
    return nn.Sequential(
        nn.Conv2d(3, n_channels, kernel_size), nn.MaxPool2d(kernel_size), nn.ReLU(),
        nn.Conv2d(n_channels, n_channels, kernel_size), nn.MaxPool2d(kernel_size), nn.ReLU(),
        nn.Flatten(), nn.Linear(n_features, n_classes),
    )  # fmt: skip


@pytest.mark.parametrize("loss_type", ["cross_entropy", "mse"])
def test_asdl_fisher_shapes_with_param_grad(loss_type):
    """``test_param_grad_w_fisher_emp`` and ``test_shape_selection_in_ngd`` on its convnet
    (batch of 3, labels all 0, one-hot targets under MSE): the empirical Fisher computed in the
    same backward as ``.grad`` (``calc_emp_loss_grad=True``) leaves ``.grad`` that of a plain
    ``loss.backward()``; its full, layer-wise and diagonal shapes (``SHAPE_FULL``,
    ``SHAPE_LAYER_WISE``, ``SHAPE_DIAG``: ``Σ_n g_n g_nᵀ / n`` of the mean loss's examples,
    from ``grad1``, its per-layer blocks and ``h.sum_grad_sq()``) are the loop's; and the exact
    Fisher (``FISHER_EXACT``, full: ``Σ_n J_nᵀ H_n J_n / n``) from gradhooks' per-example
    Jacobians is ``vmap(jacrev)``'s."""
    model = seeded(asdl_convnet).to(D)
    plain = deepcopy(model)
    x = torch.randn(3, 3, 32, 32, dtype=D, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(3, dtype=torch.long)
    if loss_type == "mse":
        target = F.one_hot(y, 10).to(D)
        loss_of = lambda out, t: F.mse_loss(out, t)  # noqa: E731
        per_example = lambda out, t: F.mse_loss(out, t, reduction="sum") / 10  # noqa: E731
    else:
        target = y
        loss_of = per_example = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    with gradhooks.add_hooks(model, quantities=("grad1", "sum_grad_sq")) as h:
        loss_of(model(x), target).backward()
        diag = h.sum_grad_sq()
    loss_of(plain(x), target).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert_close(p.grad, q.grad, f"{name}: .grad as a plain backward's")
    want = loop_grad(model, lambda out, t: per_example(out, t), x, target)
    g = flat_grads(grad1_of(model))
    assert_close(g.T @ g / 3, flat_grads(want).T @ flat_grads(want) / 3, "full")
    for name, p in model.named_parameters():
        gp = p.grad1.flatten(1)
        wp = want[name].flatten(1)
        assert_close(gp.T @ gp / 3, wp.T @ wp / 3, f"layer-wise: {name}")
        assert_close(diag[name] / 3, (want[name] ** 2).sum(0) / 3, f"diagonal: {name}")
    model.zero_grad(set_to_none=True)
    jac = gradhooks.jacobians(model, x, flatten=True)  # [n, 10, P]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def out_of(theta, xi):
        return torch.func.functional_call(model, theta, (xi[None],))[0]

    ref = torch.func.vmap(torch.func.jacrev(out_of), in_dims=(None, 0))(params, x)
    ref = torch.cat([ref[n].flatten(2) for n in params], 2)
    assert_close(jac, ref, "per-example Jacobians")
    with torch.no_grad():
        out = model(x)
    if loss_type == "mse":
        hess = 2 / 10 * torch.eye(10, dtype=D).expand(3, 10, 10)
    else:
        p = out.softmax(-1)
        hess = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    fisher = torch.einsum("nop,noq,nqr->pr", jac, hess, jac) / 3
    want_f = torch.einsum("nop,noq,nqr->pr", ref, hess, ref) / 3
    assert_close(fisher, want_f, "exact Fisher, full")

"""A fifth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` /
``jacrev`` and per-example loops). The first four sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` and
:mod:`test_peer_suites_fourth`; this one adds:

- Opacus (``tests/grad_samples/input_projection_test.py``, ``tests/per_sample_gradient_test.py``,
  ``tests/privacy_engine_test.py``): the input projections of its current
  ``DPMultiheadAttention`` (raw weights, one per query / key / value or one packed weight cut
  in three, applied by ``F.linear`` to slices of one concatenated time-major input), that
  attention with a key and value shorter or longer than the query (padded to the query's
  length, cut back after the projection) and with its options (``add_bias_kv``,
  ``add_zero_attn``, ``key_padding_mask``), the per-layer checks of its clipper under its
  ``L1Loss`` (``mean`` and ``sum``) on the squeezed output, and the privacy engine's own
  models: the text model (an embedding, that attention, a Linear, time-major), the model of
  custom layers (``F.linear`` on ``_weight``, a parameter multiplied in a parent's and in the
  root's ``forward``) and the model whose embedding is tied to its output Linear, each by a
  DP step by every clipping method, its flat clipping of a batch of one and its comparison
  with vanilla training through ``step(closure)``; and its attention swapped into an
  ``nn.TransformerEncoderLayer`` (refused, with the remedy checked);
- curvlinops (``test/test_kfac.py``): K-FAC of a weight tied between two Linears (one bias
  tied too, biases on one use only, two different biases), of a network with in-place
  activations (exact for one datum), of outputs with several leading dimensions against the
  same positions as a batch (and its classes-first cross-entropy model, whose labels the
  named loss refuses), and factors computed without touching ``.grad``;
- BackPACK (``test/extensions/secondorder/diag_ggn``, ``sqrt_ggn``): ``DiagGGNExact``,
  ``BatchDiagGGNExact`` and ``SqrtGGNExact`` of its second-order problem networks (convolutions,
  a transposed one, pooling, its activations) under ``mean`` and ``sum``, from gradhooks'
  per-example Jacobians;
- nngeometry (``tests/tasks.py``, ``tests/test_torch_hooks.py``): per-example Jacobians of its
  newer tasks (strided 1-d convolutions, LayerNorm without bias and RMSNorm after a Linear and
  a convolution, layers on ``[batch, 5, 4]`` summed over positions, one Linear used twice),
  and a model left holding ``functional_call``'s tensors refused by name;
- functorch (``test/functorch/test_eager_transforms.py``, ``TestVmapOfGrad``): its
  per-sample-gradient functions written as modules over the batch (an in-place ``squeeze_``
  of a view, ``new_zeros`` / ``new_empty`` filled by ``copy_``, its embedding net), and the
  per-example function run on examples taken out of the batch, refused.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, assert_grad1, seeded

D = torch.float64


# -- shared functions ---------------------------------------------------------------------------


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def ce_sum(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def half_sq(out: Tensor, target: Tensor | None = None) -> Tensor:
    return 0.5 * out.pow(2).sum()


class BatchFirst(nn.Module):
    """A time-major ``model`` seen batch-first, for the oracle (which takes the examples on
    dimension 0): every input ``[batch, T, ...]`` is handed on as ``[T, batch, ...]``, and a
    ``[T, batch, ...]`` output given back as ``[batch, T, ...]`` (``out_time_major``).
    Parameter names gain the prefix ``m.``."""

    def __init__(self, model: nn.Module, out_time_major: bool = True):
        super().__init__()
        self.m, self.out_time_major = model, out_time_major

    def forward(self, *xs: Tensor) -> Tensor:
        out = self.m(*[x.transpose(0, 1) for x in xs])
        return out.transpose(0, 1) if self.out_time_major else out


def unprefixed(want: dict[str, Tensor], prefix: str = "m.") -> dict[str, Tensor]:
    return {n.removeprefix(prefix): g for n, g in want.items()}


def dp_step_against_the_loop(model, inputs, y, want, batch_dim: int = 0) -> None:
    """A DP step (no noise, clipping at the median of the loop's per-example norms) by
    ``grad1``, ghost clipping and book-keeping: every ``.grad`` against the loop's clipped
    mean."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    C = norms.median().item()
    factors = (C / norms).clamp(max=1.0)
    batch = y.shape[0]
    for method in ("grad1", "ghost", "bookkeeping"):
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities, batch_dim=batch_dim) as h:
            losses = F.cross_entropy(model(*inputs), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0, method=method)
        for n, p in trainable(model).items():
            clipped = torch.einsum("b,b...->...", factors, want[n]) / batch
            assert_close(p.grad, clipped, f"DP step ({method}): {n}")
            p.grad = None
        gradhooks.clear_grad1(model)


# == Opacus: input projections (tests/grad_samples/input_projection_test.py) ======================
# Its current DPMultiheadAttention projects query, key and value in one module that takes them
# concatenated on the last dimension, time-major ([T, batch, E + kdim + vdim]), with weights of
# its own: three matrices (key and value dimensions of their own) or one packed [3E, E] matrix,
# applied by F.linear to slices of the input, the three results stacked on a new last axis.


class InputProjection(nn.Module):
    """Three projection matrices ``[E, E]``, ``[E, kdim]``, ``[E, vdim]`` and one bias
    ``[3E]`` cut in three; ``[T, batch, E + kdim + vdim]`` to ``[T, batch, E, 3]``."""

    def __init__(self, embed_dim: int, kdim: int, vdim: int, bias: bool):
        super().__init__()
        self.ends = (embed_dim, embed_dim + kdim)
        self.q_weight = nn.Parameter(torch.randn(embed_dim, embed_dim) / embed_dim**0.5)
        self.k_weight = nn.Parameter(torch.randn(embed_dim, kdim) / kdim**0.5)
        self.v_weight = nn.Parameter(torch.randn(embed_dim, vdim) / vdim**0.5)
        self.bias = nn.Parameter(torch.randn(3 * embed_dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (
            x[..., : self.ends[0]],
            x[..., self.ends[0] : self.ends[1]],
            x[..., self.ends[1] :],
        )
        biases = self.bias.chunk(3) if self.bias is not None else (None, None, None)
        weights = (self.q_weight, self.k_weight, self.v_weight)
        return torch.stack([F.linear(t, w, b) for t, w, b in zip((q, k, v), weights, biases)], -1)


class PackedInputProjection(nn.Module):
    """One packed weight ``[3E, E]`` (and bias ``[3E]``) cut in three, one third per slice of
    ``[T, batch, 3E]``; ``[T, batch, E, 3]``."""

    def __init__(self, embed_dim: int, bias: bool):
        super().__init__()
        self.embed_dim = embed_dim
        self.weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / embed_dim**0.5)
        self.bias = nn.Parameter(torch.randn(3 * embed_dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = x.split(self.embed_dim, -1)
        biases = self.bias.chunk(3) if self.bias is not None else (None, None, None)
        weights = self.weight.chunk(3)
        return torch.stack([F.linear(t, w, b) for t, w, b in zip((q, k, v), weights, biases)], -1)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_major"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kind", ["separate", "packed"])
def test_opacus_input_projection(kind, bias, batch_first):
    """Opacus' ``InputProjection_test`` / ``PackedInputProjection_test``: the projection's
    per-example gradients, batch-first or time-major (``batch_dim=1``), with and without its
    bias, under a sum and a mean loss, against ``vmap(grad)``."""
    model = seeded(
        lambda: (
            InputProjection(3, 2, 4, bias) if kind == "separate" else PackedInputProjection(3, bias)
        )
    ).double()
    x = seeded(lambda: torch.randn(5, 4, 9, dtype=D), 1)  # [batch, T, E + kdim + vdim]
    oracle_model = model if batch_first else BatchFirst(model)
    want = unprefixed(vmap_grad(oracle_model, half_sq, x))
    for reduction in ("sum", "mean"):
        with gradhooks.add_hooks(
            model, loss_reduction=reduction, batch_dim=0 if batch_first else 1
        ):
            loss = half_sq(model(x if batch_first else x.transpose(0, 1)))
            (loss if reduction == "sum" else loss / 5).backward()
        assert_grad1(model, want, f"{kind}, {reduction}")
        gradhooks.clear_grad1(model)
        model.zero_grad(set_to_none=True)


class ProjectedAttention(nn.Module):
    """Opacus' ``DPMultiheadAttention`` (no dropout, no masks), time-major: the key and value
    are padded (or the query) to a common length so that the three concatenate, projected
    together by :class:`InputProjection` (or :class:`PackedInputProjection` where the
    dimensions agree), cut back, then scaled dot-product attention per head and ``out_proj``.
    ``forward(query [T, batch, E], key [S, batch, kdim], value [S, batch, vdim])``."""

    def __init__(
        self, embed_dim: int, heads: int, kdim: int | None = None, vdim: int | None = None
    ):
        super().__init__()
        self.heads = heads
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        if kdim == vdim == embed_dim:
            self.in_proj = PackedInputProjection(embed_dim, bias=True)
        else:
            self.in_proj = InputProjection(embed_dim, kdim, vdim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        T, batch, E = query.shape
        pad = T - key.shape[0]
        if pad > 0:
            key, value = F.pad(key, (0, 0, 0, 0, 0, pad)), F.pad(value, (0, 0, 0, 0, 0, pad))
        elif pad < 0:
            query = F.pad(query, (0, 0, 0, 0, 0, -pad))
        q, k, v = self.in_proj(torch.cat((query, key, value), -1)).unbind(-1)
        if pad > 0:
            k, v = k[:-pad], v[:-pad]
        elif pad < 0:
            q = q[:pad]
        head_dim = E // self.heads
        q = (q * head_dim**-0.5).contiguous().view(T, batch * self.heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, batch * self.heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, batch * self.heads, head_dim).transpose(0, 1)
        weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1)
        out = torch.bmm(weights, v).transpose(0, 1).contiguous().view(T, batch, E)
        return self.out_proj(out)


class CrossAttention(nn.Module):
    """``forward(query [T, batch, 4], memory [S, batch, kdim + vdim])``: the memory split into
    key and value."""

    def __init__(self, kdim: int, vdim: int):
        super().__init__()
        self.kdim = kdim
        self.attn = ProjectedAttention(4, 2, kdim, vdim)

    def forward(self, query: Tensor, memory: Tensor) -> Tensor:
        return self.attn(query, memory[..., : self.kdim], memory[..., self.kdim :])


@pytest.mark.parametrize(
    "T, S, kdim, vdim",
    [(3, 5, 4, 4), (5, 3, 4, 4), (3, 5, 2, 3), (5, 2, 3, 2)],
    ids=["packed_short_query", "packed_long_query", "separate_short_query", "separate_long_query"],
)
def test_opacus_attention_through_its_input_projection(T, S, kdim, vdim):
    """Opacus' ``dp_multihead_attention_test.py`` with its current projection: cross-attention
    whose key and value are shorter or longer than the query (the padding to a common length
    and the cut after the projection), time-major; ``grad1`` against ``vmap(grad)``."""
    model = seeded(lambda: CrossAttention(kdim, vdim)).double()
    q = seeded(lambda: torch.randn(4, T, 4, dtype=D), 1)
    memory = seeded(lambda: torch.randn(4, S, kdim + vdim, dtype=D), 2)
    want = unprefixed(vmap_grad(BatchFirst(model), half_sq, (q, memory)))
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=1):
        half_sq(model(q.transpose(0, 1), memory.transpose(0, 1))).backward()
    assert_grad1(model, want, f"T={T}, S={S}")


class TimeMajorSequenceBias(nn.Module):
    """Opacus' ``SequenceBias`` as its attention uses it: ``[T, batch, F]`` to
    ``[T + 1, batch, F]``, a learned vector appended to every sequence."""

    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.bias.repeat(1, x.shape[1], 1)])


class AttentionWithOptions(nn.Module):
    """:class:`ProjectedAttention`'s self-attention with the options of Opacus'
    ``DPMultiheadAttention``: ``add_bias_kv`` (a learned key and value appended to every
    sequence, :class:`TimeMajorSequenceBias`), ``add_zero_attn`` (a zero key and value
    appended per head) and a ``key_padding_mask`` ``[batch, T]`` (padded up with the
    appended positions). ``forward(x [T, batch, E], mask [batch, T])``."""

    def __init__(self, bias_kv: bool, zero_attn: bool, masked: bool):
        super().__init__()
        self.attn = ProjectedAttention(4, 2)
        self.zero_attn, self.masked = zero_attn, masked
        self.bias_k = TimeMajorSequenceBias(4) if bias_kv else None
        self.bias_v = TimeMajorSequenceBias(4) if bias_kv else None

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        T, batch, E = x.shape
        heads, head_dim = self.attn.heads, E // self.attn.heads
        mask = mask if self.masked else None
        q, k, v = self.attn.in_proj(torch.cat((x, x, x), -1)).unbind(-1)
        if self.bias_k is not None:
            k, v = self.bias_k(k), self.bias_v(v)
            mask = None if mask is None else F.pad(mask, (0, 1))
        q = (q * head_dim**-0.5).contiguous().view(T, batch * heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, batch * heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, batch * heads, head_dim).transpose(0, 1)
        if self.zero_attn:
            zeros = k.new_zeros(k.shape[0], 1, head_dim)
            k, v = torch.cat([k, zeros], 1), torch.cat([v, zeros], 1)
            mask = None if mask is None else F.pad(mask, (0, 1))
        scores = torch.bmm(q, k.transpose(1, 2))
        if mask is not None:
            S = k.shape[1]
            scores = scores.view(batch, heads, T, S).masked_fill(mask[:, None, None], float("-inf"))
            scores = scores.view(batch * heads, T, S)
        out = torch.bmm(scores.softmax(-1), v).transpose(0, 1).contiguous().view(T, batch, E)
        return self.attn.out_proj(out)


class MaskBatchFirst(nn.Module):
    """For the oracle: ``x`` ``[batch, T, E]`` and the mask ``[batch, T]`` to the time-major
    model, the output back batch-first."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.m(x.transpose(0, 1), mask).transpose(0, 1)


@pytest.mark.parametrize(
    "bias_kv, zero_attn, masked",
    [(False, False, True), (True, False, False), (False, True, False), (True, True, True)],
    ids=["key_padding_mask", "add_bias_kv", "add_zero_attn", "all"],
)
def test_opacus_attention_options_through_its_input_projection(bias_kv, zero_attn, masked):
    """Opacus' ``dp_multihead_attention_test.py`` options (``add_bias_kv``, ``add_zero_attn``,
    ``key_padding_mask``) with its current packed projection, time-major: ``grad1`` of the
    projection, the appended biases and ``out_proj`` against the per-example loop; two
    sequences padded at the end."""
    model = seeded(lambda: AttentionWithOptions(bias_kv, zero_attn, masked)).double()
    x = seeded(lambda: torch.randn(3, 5, 4, dtype=D), 1)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:], mask[2, 4:] = True, True
    want = unprefixed(loop_grad(MaskBatchFirst(model), half_sq, (x, mask)))
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=1):
        half_sq(model(x.transpose(0, 1), mask)).backward()
    assert_grad1(model, want, f"bias_kv={bias_kv}, zero_attn={zero_attn}, masked={masked}")


# == Opacus: the privacy engine's models (tests/privacy_engine_test.py) ===========================


class SampleAttnNet(nn.Module):
    """Its text model, time-major: ``[T, batch]`` tokens, an embedding, self-attention through
    :class:`ProjectedAttention`, a Linear to one score per position, the scores of the ``T``
    positions as ``[batch, T]`` class logits. Every parameter uniform in ``[0, 1)``, as there."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.attn = ProjectedAttention(8, 1)
        self.fc = nn.Linear(8, 1)
        for p in self.parameters():
            nn.init.uniform_(p)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        h = self.fc(self.attn(h, h, h))
        h = h.permute(1, 0, 2)
        return h.reshape(h.shape[0], -1)


class CustomLinear(nn.Module):
    """``F.linear`` on parameters of its own, ``_weight`` and ``_bias`` (its
    ``CustomLinearModule``)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self._weight = nn.Parameter(torch.randn(outputs, inputs))
        self._bias = nn.Parameter(torch.randn(outputs))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self._weight, self._bias)


class LinearWithExtraParam(nn.Module):
    """A Linear, then a parameter of the parent's own by ``matmul``."""

    def __init__(self, inputs: int, outputs: int, hidden: int = 8):
        super().__init__()
        self.fc = nn.Linear(inputs, hidden)
        self.extra_param = nn.Parameter(torch.randn(hidden, outputs))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x).matmul(self.extra_param)


class ModelWithCustomLinear(nn.Module):
    """The two layers above, then a parameter of the root module by ``matmul``."""

    def __init__(self):
        super().__init__()
        self.fc1 = CustomLinear(4, 8)
        self.fc2 = LinearWithExtraParam(8, 4)
        self.extra_param = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x)).matmul(self.extra_param)


class SampleTiedWeights(nn.Module):
    """One ``[30, 8]`` parameter, uniform in ``[-100, 100]``, both the embedding's table and the
    output Linear's weight; a token per example seen as a sequence of one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 30)
        tied = nn.Parameter(torch.empty(30, 8).uniform_(-100, 100))
        self.emb.weight = self.fc2.weight = tied

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(self.emb(x.unsqueeze(1)))).squeeze(1)


def privacy_engine_model(name: str, batch: int):
    """``(model, inputs, labels, batch_dim, oracle_model)`` of one of its models."""
    torch.manual_seed(0)
    if name == "text":
        model = SampleAttnNet().double()
        x = torch.randint(0, 30, (6, batch))  # [T, batch]
        return model, x, torch.randint(0, 6, (batch,)), 1, BatchFirst(model, False)
    if name == "custom":
        model = ModelWithCustomLinear().double()
        return model, torch.randn(batch, 4, dtype=D), torch.randint(0, 3, (batch,)), 0, model
    model = SampleTiedWeights().double()
    return model, torch.randint(0, 30, (batch,)), torch.randint(0, 30, (batch,)), 0, model


@pytest.mark.parametrize("name", ["text", "custom", "tied"])
def test_opacus_privacy_engine_models_dp_step(name):
    """``PrivacyEngineTextTest``, ``PrivacyEngineCustomLayerTest`` and
    ``PrivacyEngineTiedWeightsTest`` (and their ``functorch`` variants, which Opacus runs for
    layers without a grad sampler: here every layer goes through its rule, ``F.linear`` on a
    module's own parameters included): ``grad1`` against the per-example loop, then a DP
    step by every clipping method against the loop's clipped mean. The tied model's logits
    are in the thousands (its weights in ``[-100, 100]``): the softmax saturates."""
    model, x, y, batch_dim, oracle_model = privacy_engine_model(name, 6)
    oracle_x = x.T if batch_dim == 1 else x
    want = unprefixed(loop_grad(oracle_model, ce_sum, oracle_x, y))
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=batch_dim):
        ce_sum(model(x), y).backward()
    assert_grad1(model, want, name)
    gradhooks.clear_grad1(model)
    model.zero_grad(set_to_none=True)
    dp_step_against_the_loop(model, x, y, want, batch_dim)


@pytest.mark.parametrize("name", ["text", "custom", "tied"])
def test_opacus_flat_clipping_of_a_batch_of_one(name):
    """``test_flat_clipping``: with one example and no noise, the clipped gradient is the
    example's own gradient scaled to norm ``C`` where it is longer (``C`` below the loop's
    norm here: the norm is ``C`` itself), the same direction."""
    model, x, y, batch_dim, oracle_model = privacy_engine_model(name, 1)
    want = unprefixed(loop_grad(oracle_model, ce_sum, x.T if batch_dim == 1 else x, y))
    norm = torch.cat([g.flatten() for g in want.values()]).norm().item()
    C = norm / 3
    with gradhooks.add_hooks(model, quantities=("norms",), batch_dim=batch_dim) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0)
    got = torch.cat([p.grad.flatten() for p in trainable(model).values()])
    assert abs(got.norm().item() - C) <= 1e-9 * C, f"{name}: norm {got.norm().item()} != {C}"
    for n, p in trainable(model).items():
        assert_close(p.grad, want[n][0] * (C / norm), f"{name}: {n}")


@pytest.mark.parametrize("clip", [False, True], ids=["no_clipping", "clipping"])
def test_opacus_compare_to_vanilla_with_a_closure(clip):
    """``test_compare_to_vanilla`` with ``use_closure=True`` and three steps: the custom-layer
    model trained by ``DPOptimizer.step(closure)`` (the closure runs the forward and
    ``opt.backward`` of the per-example losses), no noise, against SGD on the loop's
    gradients: without clipping (``C`` far above every norm) the mean gradient, vanilla
    training; with ``C`` at the median norm, the loop's clipped mean. Opacus' closure calls a
    plain ``loss.backward()``; gradhooks refuses that step (``StateError``: nothing was
    clipped), rather than step on an unclipped gradient."""
    model, x, y, _, _ = privacy_engine_model("custom", 6)
    reference = copy.deepcopy(model)
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    opt = gradhooks.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        hooks,
        max_grad_norm=1e12,
        noise_multiplier=0.0,
        expected_batch_size=6,
    )

    def closure():
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        opt.backward(losses)
        return losses.mean()

    for step in range(3):
        want = loop_grad(reference, ce_sum, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
        C = norms.median().item() if clip else 1e12
        factors = (C / norms).clamp(max=1.0)
        opt.max_grad_norm = C
        opt.step(closure)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p -= 0.1 * torch.einsum("b,b...->...", factors, want[n]) / 6
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.detach(), q.detach(), f"step {step}: {n}")

    def plain_closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(gradhooks.StateError, match="no backward"):
        opt.step(plain_closure)
    hooks.remove()


# == Opacus: per-layer checks of its clipper (tests/per_sample_gradient_test.py) ==================
# Each layer alone, its output squeezed, an L1 loss against zeros (mean and sum over every
# element); the examples on dimension 0 except for SequenceBias (time-major, batch_dim=1).


def _ints(*shape):
    return lambda: torch.randint(0, 20, shape)


def _floats(*shape):
    return lambda: torch.randn(*shape, dtype=D)


CLIPPER_LAYERS = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3), _floats(5, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3), _floats(5, 4, 6, 6)),
    "linear": (lambda: nn.Linear(8, 4), _floats(5, 8)),
    "linear_3d": (lambda: nn.Linear(8, 4), _floats(5, 3, 8)),
    "layer_norm_1": (lambda: nn.LayerNorm(6), _floats(5, 4, 3, 6)),
    "layer_norm_2": (lambda: nn.LayerNorm((3, 6)), _floats(5, 4, 3, 6)),
    "layer_norm_3": (lambda: nn.LayerNorm((4, 3, 6)), _floats(5, 4, 3, 6)),
    "group_norm_1d": (lambda: nn.GroupNorm(2, 4), _floats(5, 4, 6)),
    "group_norm_2d": (lambda: nn.GroupNorm(2, 4), _floats(5, 4, 6, 5)),
    "group_norm_3d": (lambda: nn.GroupNorm(2, 4), _floats(5, 4, 3, 4, 5)),
    "instance_norm_1d": (lambda: nn.InstanceNorm1d(4, affine=True), _floats(5, 4, 6)),
    "instance_norm_2d": (lambda: nn.InstanceNorm2d(4, affine=True), _floats(5, 4, 6, 5)),
    "instance_norm_3d": (lambda: nn.InstanceNorm3d(4, affine=True), _floats(5, 4, 3, 4, 5)),
    "embedding_2d": (lambda: nn.Embedding(20, 6), _ints(5, 7)),
    "embedding_3d": (lambda: nn.Embedding(20, 6), _ints(5, 4, 3)),
    "sequence_bias": (lambda: TimeMajorSequenceBias(2), _floats(4, 5, 2)),  # [T, batch, F]
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CLIPPER_LAYERS))
def test_opacus_clipper_layers_under_l1_loss(name, reduction):
    """Opacus' ``PerSampleGradientTest``: every layer's ``grad1`` under ``L1Loss`` (``mean``:
    example ``i``'s loss is the mean of its own entries; ``sum``) against the per-example
    loop; the affine parameters of instance norm, which normalizes each example alone, are
    per-example too."""
    factory, inputs = CLIPPER_LAYERS[name]
    model = seeded(factory).double()
    x = seeded(inputs, 1)
    time_major = name == "sequence_bias"

    def l1(out: Tensor, target: Tensor | None = None) -> Tensor:
        out = out.squeeze()
        return F.l1_loss(out, torch.zeros_like(out), reduction=reduction)

    oracle_model = BatchFirst(model) if time_major else model
    want = unprefixed(loop_grad(oracle_model, l1, x.transpose(0, 1) if time_major else x))
    with gradhooks.add_hooks(model, loss_reduction=reduction, batch_dim=1 if time_major else 0):
        l1(model(x)).backward()
    assert_grad1(model, want, f"{name}, {reduction}")


class LinearsAttention(nn.Module):
    """Opacus' ``DPMultiheadAttention`` as its current version is (three Linears for query, key
    and value, ``out_proj``, ``batch_first``, the signature ``nn.TransformerEncoderLayer``
    calls, ``is_causal`` included; ``_qkv_same_embed_dim = False`` and no ``in_proj_weight``,
    so that the layer takes no fast path), without its options."""

    def __init__(self, embed_dim: int, heads: int, batch_first: bool):
        super().__init__()
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, heads, batch_first
        self._qkv_same_embed_dim = False
        self.in_proj_weight = self.in_proj_bias = None
        self.qlinear, self.klinear = (
            nn.Linear(embed_dim, embed_dim),
            nn.Linear(embed_dim, embed_dim),
        )
        self.vlinear, self.out_proj = (
            nn.Linear(embed_dim, embed_dim),
            nn.Linear(embed_dim, embed_dim),
        )

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, is_causal=False):  # fmt: skip
        if self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        T, batch, E = query.shape
        head_dim = E // self.num_heads
        q = (self.qlinear(query) * head_dim**-0.5).contiguous()
        q = q.view(T, batch * self.num_heads, head_dim).transpose(0, 1)
        k = (
            self.klinear(key)
            .contiguous()
            .view(-1, batch * self.num_heads, head_dim)
            .transpose(0, 1)
        )
        v = (
            self.vlinear(value)
            .contiguous()
            .view(-1, batch * self.num_heads, head_dim)
            .transpose(0, 1)
        )
        weights = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        out = self.out_proj(torch.bmm(weights, v).transpose(0, 1).contiguous().view(T, batch, E))
        return (out.transpose(0, 1) if self.batch_first else out), None


class OwnForwardEncoderLayer(nn.TransformerEncoderLayer):
    """The remedy the refusal names: the layer with a forward of its own, so that it does not
    take ``nn.TransformerEncoderLayer``'s rule and its parts are hooked one by one."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class OwnForwardAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` subclass with a forward of its own (so without the
    attention's rule: the registry does not hand a rule to a subclass that overrides
    ``forward``)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


SWAPPED_ATTENTION = {
    "opacus": lambda batch_first: LinearsAttention(8, 2, batch_first),
    "mha_subclass": lambda batch_first: OwnForwardAttention(8, 2, batch_first=batch_first),
}


@pytest.mark.parametrize("attention", list(SWAPPED_ATTENTION))
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_major"])
def test_opacus_dp_attention_inside_a_transformer_encoder_layer(batch_first, attention):
    """Opacus' ``ModuleValidator.fix`` swaps an ``nn.TransformerEncoderLayer``'s
    ``nn.MultiheadAttention`` for its ``DPMultiheadAttention`` (its ``is_causal`` argument and
    ``in_proj_weight = None`` exist for that layer). gradhooks' rule for the layer hands its
    parts to their own rules in the layout of torch's parts; the swapped-in attention's
    Linears were left out (a ``RuleError`` at the backward, "returned no piece"), or, with a
    parameter of its own and time-major, read batch-first (a ``MixedExamplesError`` from the
    fallback). So was an ``nn.MultiheadAttention`` subclass with a forward of its own. Both are
    now refused at the forward (``UnsupportedError`` naming the part and the remedies); with
    the remedy it names, a forward of the layer's own, every parameter's ``grad1`` matches the
    per-example loop, batch-first or time-major."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    layer.self_attn = SWAPPED_ATTENTION[attention](batch_first)
    layer = layer.double()
    x = seeded(lambda: torch.randn(3, 5, 8, dtype=D), 1)  # [batch, T, E]
    given = x if batch_first else x.transpose(0, 1)
    batch_dim = 0 if batch_first else 1
    with gradhooks.add_hooks(layer, batch_dim=batch_dim):
        with pytest.raises(gradhooks.UnsupportedError, match="'self_attn' is a"):
            layer(given)
    own = OwnForwardEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    own.self_attn = SWAPPED_ATTENTION[attention](batch_first)
    own = own.double()
    own.load_state_dict(layer.state_dict())
    want = unprefixed(loop_grad(BatchFirst(own) if not batch_first else own, half_sq, x))
    with gradhooks.add_hooks(own, loss_reduction="sum", batch_dim=batch_dim):
        half_sq(own(given)).backward()
    assert_grad1(own, want, "own forward")


# == curvlinops: K-FAC (test/test_kfac.py) ========================================================


def ggn_of_one_example(model: nn.Module, x: Tensor, loss_hessian: Tensor) -> dict[str, Tensor]:
    """``{name: Jᵀ H J}`` of one example ``x`` ``[1, ...]``: ``J`` the Jacobian of the
    flattened output with respect to the parameter (``jacrev``), ``H`` the loss's Hessian with
    respect to that output; the diagonal blocks of the GGN, one per parameter."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    with gradhooks.paused():
        J = jacrev(lambda p: functional_call(model, p, (x,)).reshape(-1))(params)
    return {n: J[n].flatten(1).T @ loss_hessian @ J[n].flatten(1) for n in J}, J


class WeightTiedSplitConcat(nn.Module):
    """curvlinops' ``WeightTiedSplitConcatModel``: ``[batch, 2D]`` split in halves, each through
    its own Linear, the two weights tied; ``biases``: ``"tied"`` (both Linears share one
    bias too), ``"first"`` (only the first has one), ``"both"`` (two different biases)."""

    def __init__(self, d: int, biases: str):
        super().__init__()
        self.d = d
        self.linear1 = nn.Linear(d, d)
        self.linear2 = nn.Linear(d, d, bias=biases != "first")
        self.linear2.weight = self.linear1.weight
        if biases == "tied":
            self.linear2.bias = self.linear1.bias

    def forward(self, x: Tensor) -> Tensor:
        a, b = x.split(self.d, -1)
        return torch.cat([self.linear1(a), self.linear2(b)], -1)


@pytest.mark.parametrize("biases", ["tied", "first", "both"])
def test_curvlinops_kfac_of_a_weight_tied_between_two_linears(biases):
    """``test_kfac_type2_weight_tying`` / ``test_kfac_type2_mixed_bias_weight_tying`` /
    ``test_kfac_type2_multi_module_conflicting_biases``: one example under MSE (loss Hessian
    ``2·I``), the two uses of the weight independent, so K-FAC (expand, ``fisher="exact"``) is
    the GGN's block of the weight, exactly.

    - ``tied``: the bias is tied too; the bias-augmented factors are the GGN of ``[W, b]``.
    - ``first``: curvlinops pads the second use's input with a zero for the missing bias;
      gradhooks refuses the bias-augmented factors (``UnsupportedError``: the weight is used
      with and without a bias) and gives the weight's own with ``bias=False``.
    - ``both``: curvlinops refuses (two biases, no one column); gradhooks gives factors whose
      bias column names no bias (``bias_name`` ``None``): the weight's block of them is
      exact, and preconditioning with them is refused (``ConfigurationError``)."""
    model = seeded(lambda: WeightTiedSplitConcat(3, biases)).double()
    x = seeded(lambda: torch.rand(1, 6, dtype=D), 1)
    ggn, J = ggn_of_one_example(model, x, 2 * torch.eye(6, dtype=D))
    if biases == "first":
        with pytest.raises(gradhooks.UnsupportedError, match="linear1.weight"):
            gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum")
        f = gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum", bias=False)
        assert_close(
            torch.kron(f["linear1.weight"].G, f["linear1.weight"].A), ggn["linear1.weight"], "W"
        )
        return
    f = gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum")["linear1.weight"]
    assert f.bias
    if biases == "tied":
        assert f.bias_name == "linear1.bias"
        Jwb = torch.cat([J["linear1.weight"], J["linear1.bias"][..., None]], -1).flatten(1)
        assert_close(torch.kron(f.G, f.A), 2 * Jwb.T @ Jwb, "[W, b]")
        return
    assert f.bias_name is None
    assert_close(torch.kron(f.G, f.A[:-1, :-1]), ggn["linear1.weight"], "W of [W, b]")
    model.zero_grad()
    half_sq(model(x)).backward()
    with pytest.raises(gradhooks.ConfigurationError, match="name no bias"):
        gradhooks.kfac_precondition(model, {"linear1.weight": f}, damping=1e-3)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "not_inplace"])
def test_curvlinops_kfac_with_inplace_activations(inplace):
    """``test_kfac_inplace_activations``: ``Linear - ReLU(inplace) - Linear`` on one datum,
    MSE: K-FAC (``fisher="exact"``, bias-augmented) is each layer's GGN block of ``[W, b]``
    (one example, one position per weight), in-place ReLU or not."""
    model = seeded(
        lambda: nn.Sequential(nn.Linear(6, 3), nn.ReLU(inplace=inplace), nn.Linear(3, 2))
    ).double()
    x = seeded(lambda: torch.rand(1, 6, dtype=D), 1)
    with torch.no_grad():  # a unit of the hidden layer inactive, one active at least
        model[0].bias.copy_(torch.tensor([5.0, -50.0, 5.0], dtype=D))
    _, J = ggn_of_one_example(model, x, 2 * torch.eye(2, dtype=D))
    factors = gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum")
    for layer in ("0", "2"):
        f = factors[f"{layer}.weight"]
        Jwb = torch.cat([J[f"{layer}.weight"], J[f"{layer}.bias"][..., None]], -1).flatten(1)
        assert_close(torch.kron(f.G, f.A), 2 * Jwb.T @ Jwb, f"layer {layer}")


class Conv2dModel(nn.Module):
    """curvlinops' ``Conv2dModel``: one ``Conv2d(3, 2, 4, padding=2)``, its output either
    rearranged ``batch c h w -> batch (h w c)`` (``"expand-flatten"``: a loss at every pixel)
    or averaged over the pixels (``"reduce"``: ``AdaptiveAvgPool2d(1)``, flattened)."""

    def __init__(self, setting: str):
        super().__init__()
        self.conv, self.setting = nn.Conv2d(3, 2, 4, padding=2), setting

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        if self.setting == "reduce":
            return F.adaptive_avg_pool2d(out, 1).flatten(1)
        return out.permute(0, 2, 3, 1).flatten(1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("setting", ["expand-flatten", "reduce"])
def test_curvlinops_kfac_of_a_convolution_is_its_ggn(setting, reduction):
    """``test_kfac_type2_weight_sharing`` on its ``Conv2dModel``: a single convolution under
    MSE, where K-FAC is exact in the setting it is made for: expand (``fisher="exact"``, one
    backward per output entry, the pixels as positions) when the loss is at every pixel,
    reduce (``expand=False``: the patches averaged, the output-gradients summed over the
    pixels) when the pixels are averaged before the loss. ``kron(G, A)`` (bias-augmented) is
    the GGN block of ``[W, b]``, summed over the examples (divided by their number under
    ``mean``)."""
    model = seeded(lambda: Conv2dModel(setting)).double()
    x = seeded(lambda: torch.randn(3, 3, 5, 5, dtype=D), 1)
    f = gradhooks.kfac(
        model, x, fisher="exact", loss="mse", reduction=reduction, expand=setting != "reduce"
    )["conv.weight"]
    ggn = 0
    for i in range(3):
        outputs = model(x[i : i + 1]).numel()
        _, J = ggn_of_one_example(model, x[i : i + 1], 2 * torch.eye(outputs, dtype=D))
        Jwb = torch.cat([J["conv.weight"].flatten(2), J["conv.bias"][..., None]], -1).flatten(1)
        ggn = ggn + 2 * Jwb.T @ Jwb
    assert_close(torch.kron(f.G, f.A), ggn / (3 if reduction == "mean" else 1), setting)


def _bce_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(out, target, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "bce"])
def test_curvlinops_kfac_of_multi_dimensional_outputs(loss, reduction):
    """``test_multi_dim_output``: a deep linear network on ``[N, 7, 5, 5]`` inputs, output
    ``[N, 7, 5, 3]`` (classes last), against the same network on the ``N·35`` positions as a
    batch ``[N·35, 5]``. Expand K-FAC: ``A`` is the same; ``G`` sums each position's
    ``g gᵀ``, so under ``sum`` it is the same, under ``mean`` it is divided by ``N`` against
    ``N·35``. Empirical (true labels) and MC (sampled output-gradients given per position by
    ``output_grads``, the same for both). ``fisher="exact"`` on the 4-d output is refused
    (``ConfigurationError``): one backward per class would add terms between positions;
    curvlinops backpropagates every class at every position."""
    x = seeded(lambda: torch.rand(3, 7, 5, 5, dtype=D), 1)
    if loss == "cross_entropy":
        y = seeded(lambda: torch.randint(3, (3, 7, 5)), 2)
        flat_y = y.reshape(-1)
    else:
        y = seeded(lambda: torch.rand(3, 7, 5, 3, dtype=D), 2)
        flat_y = y.reshape(-1, 3)
    v = seeded(lambda: torch.randn(3, 7, 5, 3, dtype=D), 3)
    model = seeded(lambda: nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))).double()
    loss_fn = _bce_sum if loss == "bce" else loss
    scale = 35 if reduction == "mean" else 1
    runs = {
        "empirical": (dict(target=y), dict(target=flat_y)),
        "mc": (
            dict(fisher="mc", output_grads=lambda out, g: v),
            dict(fisher="mc", output_grads=lambda out, g: v.reshape(-1, 3)),
        ),
    }
    for fisher, (four_kw, flat_kw) in runs.items():
        four_kw.setdefault("fisher", fisher)
        flat_kw.setdefault("fisher", fisher)
        four = gradhooks.kfac(model, x, loss=loss_fn, reduction=reduction, **four_kw)
        flat = gradhooks.kfac(model, x.reshape(-1, 5), loss=loss_fn, reduction=reduction, **flat_kw)
        for n in four:
            assert_close(four[n].A, flat[n].A, f"{fisher} A {n}")
            assert_close(four[n].G, scale * flat[n].G, f"{fisher} G {n}")
    with pytest.raises(gradhooks.ConfigurationError, match="exact"):
        gradhooks.kfac(model, x, y, fisher="exact", loss=loss_fn, reduction=reduction)


class ClassesFirst(nn.Module):
    """curvlinops' cross-entropy model of ``test_multi_dim_output``: the deep linear network,
    then its ``Rearrange("batch ... c -> batch c ...")``: ``[batch, 3, 7, 5]``, the classes on
    dimension 1 as ``F.cross_entropy`` takes them."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).movedim(-1, 1)


@pytest.mark.parametrize(
    "target",
    ["labels_of_classes_first", "probabilities", "a_trailing_axis"],
)
def test_curvlinops_classes_first_output_with_the_named_cross_entropy(target):
    """``test_multi_dim_output``'s cross-entropy model keeps the classes on dimension 1.
    gradhooks' named ``"cross_entropy"`` takes them last, one integer label per row: with the
    classes first, labels ``[batch, 7, 5]`` (not the output's ``[batch, 3, 7]``), with
    probabilities as targets, or with labels ``[batch, 7, 5, 1]``, the target is refused
    (``ConfigurationError`` naming both shapes, where it was a bare broadcasting error). The
    loss given as a function, ``F.cross_entropy(..., reduction="sum")``, takes the classes
    first, and its factors are the named loss's on the classes-last model."""
    model = seeded(ClassesFirst).double()
    x = seeded(lambda: torch.rand(2, 7, 5, 5, dtype=D), 1)
    labels = seeded(lambda: torch.randint(3, (2, 7, 5)), 2)
    if target == "labels_of_classes_first":
        y = labels
    elif target == "probabilities":
        y = seeded(lambda: torch.rand(2, 3, 7, 5, dtype=D).softmax(1), 3)
    else:
        y = labels[..., None]
    with pytest.raises(gradhooks.ConfigurationError, match=r"target has shape \(2, "):
        gradhooks.kfac(model, x, y, fisher="empirical")
    if target != "labels_of_classes_first":
        return
    by_function = gradhooks.kfac(
        model,
        x,
        labels,
        fisher="empirical",
        loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"),
    )
    classes_last = gradhooks.kfac(model.net, x, labels, fisher="empirical")
    for n, f in classes_last.items():
        assert_close(by_function[f"net.{n}"].A, f.A, f"A {n}")
        assert_close(by_function[f"net.{n}"].G, f.G, f"G {n}")


def test_curvlinops_empirical_factors_of_labels_with_padding():
    """curvlinops' empirical Fisher (``fisher_type="empirical"``) of a language model's output
    ``[batch, T, vocab]`` with the labels a Hugging Face collator makes (dp-transformers' and
    private-transformers' pad them with ``-100``, ``F.cross_entropy``'s ``ignore_index``) and
    in ``int32``: the named ``"cross_entropy"`` ignores those positions as ``F.cross_entropy``
    does, its factors those of the function form (which was the only one that ran: the named
    loss failed in ``F.one_hot``)."""
    model = seeded(lambda: nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 6))).double()
    tokens = seeded(lambda: torch.randint(0, 11, (3, 5)), 1)
    labels = seeded(lambda: torch.randint(0, 6, (3, 5)), 2)
    labels[0, 3:], labels[2, 1:] = -100, -100
    by_function = gradhooks.kfac(
        model,
        tokens,
        labels,
        fisher="empirical",
        loss=lambda out, t: F.cross_entropy(out.flatten(0, -2), t.flatten(), reduction="sum"),
    )["1.weight"]
    for dtype in (torch.int64, torch.int32):
        named = gradhooks.kfac(model, tokens, labels.to(dtype), fisher="empirical")["1.weight"]
        assert_close(named.A, by_function.A, f"A, {dtype}")
        assert_close(named.G, by_function.G, f"G, {dtype}")
    unpadded = gradhooks.kfac(model, tokens, labels.clamp(min=0), fisher="empirical")["1.weight"]
    assert not torch.allclose(unpadded.G, by_function.G), "the ignored positions counted"


def test_curvlinops_kfac_does_not_affect_grad():
    """``test_kfac_does_not_affect_grad``: computing the factors (each ``fisher``) leaves the
    parameters' ``.grad`` as they were (one set, the others ``None``), adds no ``grad1`` and
    leaves no hooks."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    x = seeded(lambda: torch.randn(5, 3, dtype=D), 1)
    y = seeded(lambda: torch.randint(2, (5,)), 2)
    before = seeded(lambda: torch.randn(4, 3, dtype=D), 3)
    model[0].weight.grad = before.clone()
    for fisher in ("mc", "exact", "empirical"):
        gradhooks.kfac(model, x, y if fisher == "empirical" else None, fisher=fisher)
        assert torch.equal(model[0].weight.grad, before), fisher
        for n, p in model.named_parameters():
            assert not hasattr(p, "grad1"), f"{fisher}: {n} has a grad1"
            if n != "0.weight":
                assert p.grad is None, f"{fisher}: {n} got a .grad"
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.hooks_of(model)  # no hooks left behind


# == BackPACK: DiagGGN, BatchDiagGGN, SqrtGGN (test/extensions/secondorder) ======================
# BackPACK's second-order extensions backpropagate the square root S of each example's loss
# Hessian with respect to its output (CrossEntropy: diag(p) - p pᵀ; MSE, sum over outputs:
# 2·I), scaled by 1/N under a mean loss: SqrtGGNExact is Jᵢᵀ Sᵢ per example and class,
# BatchDiagGGNExact each example's diag(Jᵢᵀ Hᵢ Jᵢ), DiagGGNExact their sum. Here Jᵢ comes from
# gradhooks.jacobians, the reference from jacrev and torch.func.hessian, one example at a time.


SECOND_ORDER_NETS = {
    "conv_sigmoid_maxpool": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2, padding=1),
            nn.Sigmoid(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(12, 3),
        ),
        (2, 4, 4),
    ),
    "convtranspose_tanh_avgpool": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 2, 2, stride=1),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8, 3),
        ),
        (2, 3, 3),
    ),
    "conv1d_elu_adaptive": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3, dilation=2),
            nn.ELU(),
            nn.AdaptiveAvgPool1d(2),
            nn.Flatten(),
            nn.Linear(6, 3),
        ),
        (2, 8),
    ),
    "mlp_leaky_logsigmoid": (
        lambda: nn.Sequential(
            nn.Linear(5, 4), nn.LeakyReLU(0.1), nn.Linear(4, 4), nn.LogSigmoid(), nn.Linear(4, 3)
        ),
        (5,),
    ),
}


def _loss_of_one(loss: str):
    if loss == "cross_entropy":
        return lambda out, y: F.cross_entropy(out, y, reduction="sum")
    return lambda out, y: F.mse_loss(out, y, reduction="sum")


@pytest.mark.parametrize("loss, reduction", [("cross_entropy", "mean"), ("mse", "sum")])
@pytest.mark.parametrize("net", list(SECOND_ORDER_NETS))
def test_backpack_diag_ggn_from_per_example_jacobians(net, loss, reduction):
    """BackPACK's ``DiagGGNExact`` / ``BatchDiagGGNExact`` / ``SqrtGGNExact`` on its problem
    networks: from ``gradhooks.jacobians`` and the closed-form loss Hessians, against the
    per-example loop (``jacrev`` of a batch of one, ``torch.func.hessian`` of its loss), every
    parameter, ``1/N`` under ``mean``."""
    factory, shape = SECOND_ORDER_NETS[net]
    model = seeded(factory).double()
    N = 4
    x = seeded(lambda: torch.randn(N, *shape, dtype=D), 1)
    y = seeded(
        lambda: torch.randint(3, (N,)) if loss == "cross_entropy" else torch.randn(N, 3, dtype=D),
        2,
    )
    scale = 1 / N if reduction == "mean" else 1.0
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss_of_one = _loss_of_one(loss)

    J = gradhooks.jacobians(model, x)  # {name: [N, 3, *p.shape]}
    with gradhooks.paused():
        out = model(x).detach()
    if loss == "cross_entropy":
        p = out.softmax(-1)
        H = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    else:
        H = 2 * torch.eye(3, dtype=D).expand(N, 3, 3)
    batch_diag = {
        n: scale * torch.einsum("nc...,ncd,nd...->n...", Jn, H, Jn) for n, Jn in J.items()
    }
    # the square root of each Hessian: S Sᵀ = H
    eigvals, eigvecs = torch.linalg.eigh(H)
    S = eigvecs * eigvals.clamp(min=0).sqrt()[:, None, :]
    sqrt_ggn = {n: scale**0.5 * torch.einsum("nc...,ncd->dn...", Jn, S) for n, Jn in J.items()}

    diag_ggn = {n: torch.zeros_like(q) for n, q in params.items()}
    for i in range(N):
        xi, yi = x[i : i + 1], y[i : i + 1]
        with gradhooks.paused():
            Ji = jacrev(lambda q, xi=xi: functional_call(model, q, (xi,)).reshape(-1))(params)
            out_i = functional_call(model, params, (xi,)).reshape(-1)
            Hi = hessian(lambda o, yi=yi: loss_of_one(o.view(1, 3), yi))(out_i)
        for n in params:
            Jin = Ji[n].flatten(1)
            ggn_i = scale * Jin.T @ Hi @ Jin
            want = ggn_i.diagonal().view_as(params[n])
            diag_ggn[n] += want
            assert_close(batch_diag[n][i], want, f"BatchDiagGGN {n}, example {i}")
            root = sqrt_ggn[n][:, i].flatten(1)
            assert_close(root.T @ root, ggn_i, f"SqrtGGN {n}, example {i}")
    for n in params:
        assert_close(batch_diag[n].sum(0), diag_ggn[n], f"DiagGGN {n}")


# == nngeometry: per-example Jacobians of its newer tasks (tests/tasks.py) =======================
# Its tasks' networks on inputs of the shapes it uses (MNIST crops, small random tensors),
# gradhooks.jacobians against vmap(jacrev) of a batch of one.


class Conv1dNet(nn.Module):
    """Three strided 1-d convolutions (one without bias) over a flattened image, a Linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 6, 3, 3)
        self.conv2 = nn.Conv1d(6, 5, 4, 8, bias=False)
        self.conv3 = nn.Conv1d(5, 2, 4, 4)
        self.fc1 = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.size(0), x.size(1), -1)
        x = F.relu(self.conv3(F.relu(self.conv2(F.relu(self.conv1(x))))))
        return self.fc1(x.view(x.size(0), -1))


class LayerNormNet(nn.Module):
    """The centre crop of an image flattened, a Linear, a LayerNorm (with or without bias) or
    an RMSNorm."""

    def __init__(self, norm: str):
        super().__init__()
        self.linear1 = nn.Linear(18 * 18, 3)
        self.layer_norm1 = _norm(norm, (3,))

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, 5:-5, 5:-5].contiguous()
        return self.layer_norm1(self.linear1(x.view(x.size(0), -1)))


class LayerNormConvNet(nn.Module):
    """A strided convolution of the crop, a norm over ``(channels, height, width)``, the sum
    over the positions."""

    def __init__(self, norm: str):
        super().__init__()
        self.layer = nn.Conv2d(1, 3, (3, 2), 2)
        self.layer_norm = _norm(norm, (3, 8, 9))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer_norm(self.layer(x[:, :, 5:-5, 5:-5])).sum(dim=(2, 3))


class SumOverPositions(nn.Module):
    """Its ``Linear3D`` / ``LayerNorm3D``: a layer on ``[batch, 5, 4]``, summed over the 5."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x).sum(dim=1)


def _norm(kind: str, shape: tuple[int, ...]) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(shape)
    return nn.LayerNorm(shape, bias=kind == "layer_norm")


NNGEOMETRY_TASKS = {
    "conv1d": (Conv1dNet, (1, 28, 28)),
    "layernorm": (lambda: LayerNormNet("layer_norm"), (1, 28, 28)),
    "layernorm_no_bias": (lambda: LayerNormNet("no_bias"), (1, 28, 28)),
    "rmsnorm": (lambda: LayerNormNet("rms"), (1, 28, 28)),
    "layernorm_conv": (lambda: LayerNormConvNet("layer_norm"), (1, 28, 28)),
    "layernorm_conv_no_bias": (lambda: LayerNormConvNet("no_bias"), (1, 28, 28)),
    "rmsnorm_conv": (lambda: LayerNormConvNet("rms"), (1, 28, 28)),
    "linear_3d": (lambda: SumOverPositions(nn.Linear(4, 3)), (5, 4)),
    "layernorm_3d": (lambda: SumOverPositions(nn.LayerNorm(4)), (5, 4)),
    "layernorm_3d_no_bias": (lambda: SumOverPositions(nn.LayerNorm(4, bias=False)), (5, 4)),
    "rmsnorm_3d": (lambda: SumOverPositions(nn.RMSNorm(4)), (5, 4)),
    # its test_shared_parameters: one Linear used twice, which nngeometry refuses
    "shared_parameters": (lambda: nn.Sequential(*[nn.Linear(4, 4)] * 2), (4,)),
}


@pytest.mark.parametrize("task", list(NNGEOMETRY_TASKS))
def test_nngeometry_jacobians_of_its_newer_tasks(task):
    """nngeometry's ``get_conv1d_task``, ``get_layernorm_task`` / ``get_layernorm_conv_task`` /
    ``get_layernorm_3d_task`` (bias or not, or RMSNorm) and ``get_linear_3d_task``: the
    per-example Jacobians ``[batch, outputs, *p.shape]`` of every parameter against
    ``vmap(jacrev)``. Its ``test_shared_parameters`` expects a refusal for a Linear used twice;
    gradhooks accepts it and sums the two uses, the derivative of the output as computed."""
    factory, shape = NNGEOMETRY_TASKS[task]
    model = seeded(factory).double()
    x = seeded(lambda: torch.rand(6, *shape, dtype=D), 1)
    # (a copy: functional_call leaves a module that appears under two names with tensors of
    # its own in place of its parameters)
    ref = copy.deepcopy(model)
    params = {n: p.detach() for n, p in ref.named_parameters()}

    def one(p, xi):
        return functional_call(ref, p, (xi.unsqueeze(0),)).reshape(-1)

    with gradhooks.paused():
        want = torch.vmap(jacrev(one), in_dims=(None, 0))(params, x)
    got = gradhooks.jacobians(model, x)
    assert set(got) == set(want), task
    for n in want:
        assert_close(got[n], want[n], f"{task}: {n}")


def test_nngeometry_shared_layer_after_functional_call_is_refused_by_name():
    """A hand-written ``vmap(jacrev(functional_call))`` reference, as nngeometry's
    ``TorchFuncJacobianBackend`` and the data-attribution tools run, on a model that lists one
    Linear under two names: ``functional_call`` leaves tensors of its own on the module in
    place of its parameters, through which autograd records nothing (a plain backward fails
    too). Hooking that model is refused with a ``ConfigurationError`` naming the parameter,
    where it was an ``AttributeError`` from inside the hooks; nothing is left on the model.
    :func:`gradhooks.oracle.vmap_grad` puts the parameters back, so the model it was given
    stays as it was."""
    model = seeded(lambda: nn.Sequential(*[nn.Linear(4, 4)] * 2)).double()
    x = seeded(lambda: torch.rand(6, 4, dtype=D), 1)
    weight = model[0].weight
    vmap_grad(model, half_sq, x)
    assert model[0].weight is weight and model[1].weight is weight, "the oracle changed the model"
    params = {n: p.detach() for n, p in model.named_parameters()}
    with gradhooks.paused():
        torch.vmap(
            jacrev(lambda p, xi: functional_call(model, p, (xi[None],)).reshape(-1)),
            in_dims=(None, 0),
        )(params, x)
    assert not isinstance(model[0].weight, nn.Parameter)  # (what functional_call left)
    with pytest.raises(gradhooks.ConfigurationError, match=r"parameter '0\.weight'"):
        gradhooks.add_hooks(model)
    with pytest.raises(gradhooks.ConfigurationError, match=r"parameter '0\.weight'"):
        gradhooks.jacobians(model, x)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(getattr(p, "_backward_hooks", None) for p in model.parameters())


# == functorch: per-sample gradients of its TestVmapOfGrad (test/functorch/test_eager_transforms.py)


class InplaceView(nn.Module):
    """``test_per_sample_grads_inplace_view``: ``x.mm(weight)`` then an in-place ``squeeze_``
    of the size-1 axis, written for the batch: ``[batch, 1, 16] @ [16, 2]``, ``squeeze_(1)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 2))

    def forward(self, x: Tensor) -> Tensor:
        return x.matmul(self.weight).squeeze_(1)


class OneExampleAtATime(InplaceView):
    """The same, written as functorch's per-example function is: each example taken out of
    the batch (``unbind``), ``mm``, ``squeeze_(0)``, stacked back."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([xi.mm(self.weight).squeeze_(0) for xi in x.unbind(0)])


class Materialized(nn.Module):
    """``test_new_zeros_materializes_tensor`` / ``test_new_empty_materializes_tensor``: a
    tensor made by ``x.new_zeros`` (or ``new_empty``), filled in place by ``copy_`` from a
    Linear's output, then used."""

    def __init__(self, empty: bool):
        super().__init__()
        self.lin, self.empty = nn.Linear(3, 5), empty

    def forward(self, x: Tensor) -> Tensor:
        shape = (x.shape[0], 5)
        out = x.new_empty(shape) if self.empty else x.new_zeros(shape)
        out.copy_(self.lin(x))
        return out.tanh()


class EmbeddingNet(nn.Module):
    """``test_per_sample_grads_embeddingnet``'s ``SampleNet``: an embedding, its transpose
    averaged over the words, two Linears."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.mean(torch.transpose(self.emb(x), -1, -2), -1)
        return self.fc2(F.relu(self.fc1(x)))


def _regression(out: Tensor, t: Tensor) -> Tensor:
    return ((out - t) ** 2).sum()


FUNCTORCH_CASES = {
    "inplace_view": (InplaceView, lambda: torch.randn(6, 1, 16, dtype=D), (6, 2), _regression),
    "new_zeros": (
        lambda: Materialized(False),
        lambda: torch.randn(6, 3, dtype=D),
        (6, 5),
        _regression,
    ),
    "new_empty": (
        lambda: Materialized(True),
        lambda: torch.randn(6, 3, dtype=D),
        (6, 5),
        _regression,
    ),
    "embeddingnet": (EmbeddingNet, lambda: torch.randint(0, 50, (6, 5)), None, ce_sum),
}


@pytest.mark.parametrize("case", list(FUNCTORCH_CASES))
def test_functorch_vmap_of_grad_modules(case):
    """functorch's ``TestVmapOfGrad`` per-sample gradients, each function written as a module
    over the batch: ``grad1`` against the per-example loop, under a sum and a mean loss."""
    factory, inputs, target_shape, loss = FUNCTORCH_CASES[case]
    model = seeded(factory).double()
    x = seeded(inputs, 1)
    if target_shape is None:
        t = seeded(lambda: torch.randint(0, 2, (6,)), 2)
    else:
        t = seeded(lambda: torch.randn(*target_shape, dtype=D), 2)
    want = loop_grad(model, loss, x, t)
    for reduction in ("sum", "mean"):
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            value = loss(model(x), t)
            (value if reduction == "sum" else value / 6).backward()
        assert_grad1(model, want, f"{case}, {reduction}")
        gradhooks.clear_grad1(model)
        model.zero_grad(set_to_none=True)


def test_functorch_examples_taken_out_of_the_batch_and_stacked_are_followed():
    """The per-example function of ``test_per_sample_grads_inplace_view`` run on each example
    taken out of the batch by ``unbind`` (a loop over the examples inside ``forward``), ``mm``
    and an in-place ``squeeze_`` on each, stacked back: the stack puts each example's row back
    in its place, which the tracker follows, so ``grad1`` is the loop's (it was refused as
    mixing before the stack of examples taken alone was followed)."""
    model = seeded(OneExampleAtATime).double()
    x = seeded(lambda: torch.randn(6, 1, 16, dtype=D), 1)
    for reduction in ("sum", "mean"):
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            value = model(x).pow(2).sum()
            (value if reduction == "sum" else value / 6).backward()
        want = loop_grad(model, lambda out: out.pow(2).sum(), x)
        assert_grad1(model, want, reduction)
        assert_grad1(model, vmap_grad(model, lambda out: out.pow(2).sum(), x), reduction)
        gradhooks.clear_grad1(model)
        model.zero_grad(set_to_none=True)


# == ASDL: empirical natural gradient (tests/test_empirical_ngd.py) ================================


def _asdl_net() -> nn.Sequential:
    """Its network: ``Linear(2, 2)`` and ``BatchNorm1d(2)``, twice."""
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2), nn.BatchNorm1d(2))


def test_asdl_empirical_natural_gradient_from_grad1():
    """ASDL's ``test_empirical_ngd``: the natural gradient of the full empirical Fisher
    ``F = (1/N) Σ gᵢ gᵢᵀ`` (``SHAPE_FULL``), ``(F + λI)⁻¹ ḡ``, against its Sherman-Morrison-
    Woodbury form from the per-example gradients ``U`` ``[N, P]``:
    ``(ḡ - Uᵀ (λN·I + U Uᵀ)⁻¹ U ḡ) / λ``. Here the SMW form is built from gradhooks' ``grad1``
    and the dense solve from the per-example loop's gradients, for two of its batches of two
    of its ten examples (all of class 0). ASDL runs the net with BatchNorm in training mode, whose
    batch statistics couple the examples; gradhooks refuses that (``MixedExamplesError``), so
    the BatchNorms run in eval mode, on running statistics of the whole data set."""
    model = seeded(_asdl_net).double()
    data = seeded(lambda: torch.randn(10, 2, dtype=D), 1)
    targets = torch.zeros(10, dtype=torch.long)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match="BatchNorm1d"):
            model(data[:2])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.momentum = None  # a cumulative average
        model(data)  # running statistics
    model.eval()
    damping = 1e-2
    for start in (0, 6):  # two of its five batches
        x, t = data[start : start + 2], targets[start : start + 2]
        N = x.shape[0]
        want = loop_grad(model, ce_sum, x, t)
        U_loop = torch.cat([want[n].flatten(1) for n in trainable(model)], 1)
        g = U_loop.mean(0)
        fisher = U_loop.T @ U_loop / N
        dense = torch.linalg.solve(fisher + damping * torch.eye(g.numel(), dtype=D), g)
        with gradhooks.add_hooks(model):
            F.cross_entropy(model(x), t).backward()
        U = torch.cat([p.grad1.flatten(1) for p in trainable(model).values()], 1)
        gbar = torch.cat([p.grad.flatten() for p in trainable(model).values()])
        inner = torch.linalg.solve(damping * N * torch.eye(N, dtype=D) + U @ U.T, U @ gbar)
        smw = (gbar - U.T @ inner) / damping
        assert_close(smw, dense, f"examples {start}-{start + 1}")
        model.zero_grad(set_to_none=True)
        gradhooks.clear_grad1(model)

"""The torch.func fallback for modules without a rule, against vmap(grad) and a per-example loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import Case, check


class Scale(nn.Module):
    """A custom layer: no rule is registered for it."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return torch.tanh(x) * self.scale


class Buffered(nn.Module):
    """A parameter used together with buffers."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))
        self.register_buffer("mean", torch.randn(n))
        self.register_buffer("std", torch.rand(n) + 0.5)

    def forward(self, x):
        return ((x - self.mean) / self.std) @ self.weight


class Gated(nn.Module):
    """Keyword inputs: a batched gate and a shared (unbatched) mask, returning a tuple."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x, *, gate, mask, scale=2.0):
        h = (x @ self.weight) * mask + self.bias
        return h * torch.sigmoid(gate), scale * h.sum(-1)


class GatedModel(nn.Module):
    def __init__(self, n=4, seq=3):
        super().__init__()
        self.inp = nn.Linear(n, n)
        self.gated = Gated(n)
        self.register_buffer("mask", (torch.arange(seq * n).reshape(seq, n) % 3 != 0).double())

    def forward(self, x):
        a, b = self.gated(self.inp(x), gate=x.flip(-1), mask=self.mask, scale=0.5)
        return a, b


class HalfUsed(nn.Module):
    """A tuple output of which only the first element reaches the loss."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)

    def forward(self, x):
        y = x @ self.weight
        return y, y.exp()


class HalfUsedModel(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.used = HalfUsed(n)
        self.out = nn.Linear(n, 2)

    def forward(self, x):
        return self.out(self.used(x)[0])


class TokenModel(nn.Module):
    """Bare parameters in the root's forward (class token, positional embedding, a scale);
    children with rules (Linear) keep them."""

    def __init__(self, n=4, seq=3):
        super().__init__()
        self.proj = nn.Linear(5, n)
        self.cls = nn.Parameter(torch.randn(1, 1, n))
        self.pos = nn.Parameter(torch.randn(1, seq + 1, n))
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(n, 2)

    def forward(self, x):
        h = self.proj(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        return self.head(torch.tanh(h * self.gain)[:, 0])


class TiedToRule(nn.Module):
    """An Embedding (fallback) whose weight a Linear (rule) also uses, and a module called twice."""

    def __init__(self, vocab=7, n=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, n)
        self.scale = Scale(n)
        self.out = nn.Linear(n, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.scale(self.scale(self.embed(tokens))))


class UsesChildWeight(nn.Module):
    """Uses a child's weight without calling the child (as nn.MultiheadAttention does)."""

    def __init__(self, n=4):
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias) * self.gain


class Streams(nn.Module):
    """A residual over several streams (x-transformers' hyper-connections): ``prepare``, a
    method besides its forward, mixes the streams with weights computed from its parameters
    (a product of the batch with a matrix and with a vector); its forward, which combines the
    branch's output with them, uses none of its own."""

    def __init__(self, n=4, streams=2):
        super().__init__()
        self.streams = streams
        self.norm = nn.LayerNorm(n)
        self.alpha = nn.Parameter(torch.randn(n, streams + 1) / 4)
        self.beta = nn.Parameter(torch.randn(n) / 4)
        self.static_alpha = nn.Parameter(torch.randn(streams, streams + 1))

    def prepare(self, x):
        b, n, d = x.shape
        residuals = x.reshape(b // self.streams, self.streams, n, d).transpose(1, 2)
        normed = self.norm(residuals)
        alpha = (normed @ self.alpha + self.static_alpha).softmax(-1)
        beta = (normed @ self.beta).sigmoid()
        mixed = torch.einsum("bnst,bnsd->bntd", alpha, residuals)
        return mixed[..., 0, :], mixed[..., 1:, :], beta

    def forward(self, out, residuals, beta):
        residuals = residuals + torch.einsum("bnd,bns->bnsd", out, beta)
        return residuals.transpose(1, 2).flatten(0, 1)


class StreamsModel(nn.Module):
    """Calls the residual ``res`` and, before it, ``res.prepare``: a use of its parameters
    outside its call, inside the model's (which has a parameter of its own, and no rule), whose
    fallback differentiates them (``res``'s call, which uses none of them, gives them
    nothing)."""

    def __init__(self, n=4, streams=2):
        super().__init__()
        self.streams = streams
        self.res = Streams(n, streams)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.branch = nn.Linear(n, n)
        self.head = nn.Linear(n, 2)

    def forward(self, x):
        x = x.repeat_interleave(self.streams, 0) * self.gain
        branch_input, residuals, beta = self.res.prepare(x)
        x = self.res(self.branch(branch_input), residuals, beta)
        return self.head(x.unflatten(0, (-1, self.streams)).sum(1))


class StreamsStrided(StreamsModel):
    """Its output through ``as_strided``, where the tracker does not follow the batch: the
    fallback then tells which submodules' parameters are its own to differentiate from the
    submodules the recomputation calls, and the engine's account of the call's own uses."""

    def forward(self, x):
        out = super().forward(x)
        return out.as_strided(out.shape, out.stride())


class UsesCalledChildWeight(nn.Module):
    """Calls ``proj`` (a Linear, which has a rule, or a custom layer, which has none) and also
    uses its parameter directly: the two uses cannot be told apart in the recomputation."""

    def __init__(self, n=4, rule=True):
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False) if rule else Scale(n)
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        weight = self.proj.weight.T if isinstance(self.proj, nn.Linear) else self.proj.scale.diag()
        return self.proj(x) * self.gain + x @ weight


class MHA(nn.Module):
    def __init__(self, n=4, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(n, heads, batch_first=True, bias=True)

    def forward(self, x):
        seq = x.shape[1]
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        return self.attn(x, x, x, attn_mask=causal, need_weights=False)[0]


class CellPair(nn.Module):
    """An LSTMCell, whose two outputs depend on each other (``h' = o * tanh(c')``), both used."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)

    def forward(self, x):
        h, c = self.cell(x)
        return h + 0.5 * c


CASES = [
    Case("custom_layer", lambda: nn.Sequential(nn.Linear(3, 4), Scale(4)), lambda b: torch.randn(b, 2, 3)),
    Case("buffers", lambda: nn.Sequential(Buffered(3), nn.Linear(3, 2)), lambda b: torch.randn(b, 3)),
    Case("batchnorm_eval", lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval(), lambda b: torch.randn(b, 3)),
    Case("kwargs_tuple", GatedModel, lambda b: torch.randn(b, 3, 4)),
    Case("half_used_tuple", HalfUsedModel, lambda b: torch.randn(b, 4)),
    Case("bare_parameters", TokenModel, lambda b: torch.randn(b, 3, 5)),
    Case("tied_to_rule", TiedToRule, lambda b: torch.randint(7, (b, 3))),
    Case("uses_child_weight", lambda: nn.Sequential(UsesChildWeight(), nn.Linear(4, 2)), lambda b: torch.randn(b, 4)),
    Case("multihead_attention", MHA, lambda b: torch.randn(b, 3, 4)),
    Case("child_method_uses_its_parameters", StreamsModel, lambda b: torch.randn(b, 3, 4)),
    Case("child_method_output_not_followed", StreamsStrided, lambda b: torch.randn(b, 3, 4)),
    Case("layer_norm_after_linear", lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)), lambda b: torch.randn(b, 2, 3)),
]  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 4])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_fallback_matches_oracles(case, batch, reduction):
    # Only the Linear rule: everything else here (Embedding, BatchNorm, MultiheadAttention, the
    # custom layers) goes through the fallback, whichever built-in rules exist.
    check(case, batch=batch, reduction=reduction, registry=_only(nn.Linear))


def _only(*module_types):
    reg = gradhooks.Registry()
    reg._rules.update({t: gradhooks.REGISTRY._rules[t] for t in module_types})
    return reg


@pytest.mark.parametrize("rule", [True, False], ids=["rule", "fallback"])
def test_a_called_childs_parameter_used_directly_too_is_refused(rule):
    """``proj``'s call and the model's own operations both use ``proj``'s parameter, the
    direct use first: the model's recomputation would count the call's use again, so neither
    is taken."""
    model = UsesCalledChildWeight(rule=rule).double()
    ((name, param),) = model.proj.named_parameters()
    x = torch.randn(3, 4, dtype=torch.double)
    with gradhooks.add_hooks(model, registry=_only(nn.Linear)):
        with pytest.raises(gradhooks.UnsupportedError, match=f"proj.{name}"):
            model(x).sum().backward()
    assert not hasattr(param, "grad1")


class CallsThenUsesChildWeight(nn.Module):
    """Calls ``proj`` (a Linear), then uses its weight directly too, as Whisper's decoder
    takes its logits by its token embedding's weight after the embedding's call; a parameter
    of its own besides."""

    def __init__(self, n=4):
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        h = self.proj(x) * self.gain
        return h + torch.tanh(h) @ self.proj.weight.T


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_called_ruled_childs_parameter_then_used_directly_matches(reduction):
    """The direct use after the call of ``proj`` (which has a rule) is followed as a use
    outside any call, not recomputed by the model's fallback, and adds to the rule's share.
    (gradhooks once refused it, as where the use comes first.)"""
    case = Case("calls_then_uses", CallsThenUsesChildWeight, lambda b: torch.randn(b, 4))
    check(case, batch=4, reduction=reduction, registry=_only(nn.Linear))


def test_check_rule_on_a_custom_layer():
    assert gradhooks.check_rule(Scale(4), torch.randn(5, 4)).ok
    assert gradhooks.check_rule(Buffered(3), torch.randn(5, 3)).ok


def test_fallback_modules_lists_only_modules_without_a_rule():
    model = TokenModel()
    with gradhooks.add_hooks(model) as hooks:
        assert [name for name, _ in hooks.fallback_modules()] == [""]
        assert {name for name, _ in hooks.modules()} == {"", "proj", "head"}
    mha = MHA()
    with gradhooks.add_hooks(mha) as hooks:
        # nn.MultiheadAttention has its own rule (which covers out_proj too): no fallback
        assert [name for name, _ in hooks.fallback_modules()] == []
    with gradhooks.add_hooks(mha, registry=_without(nn.MultiheadAttention)) as hooks:
        # out_proj has the Linear rule, but attn uses its weight without calling it
        assert [name for name, _ in hooks.fallback_modules()] == ["attn"]


def _without(module_type):
    reg = gradhooks.Registry()
    reg._rules.update(gradhooks.REGISTRY._rules)
    reg.unregister(module_type)
    return reg


def test_children_are_not_captured_inside_the_fallback():
    """The fallback recomputes the root (bare parameters), children and all, under torch.func:
    the children's hooks must not fire there, or their grad1 would be counted twice."""
    model = TokenModel().double()
    x = torch.randn(3, 3, 5, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).sum().backward()
        want = vmap_grad(model, lambda out: out.sum(), x)  # under torch.func: no capture
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9)


def test_error_and_skip_still_work():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4))
    with pytest.raises(gradhooks.UnsupportedModuleError, match=r"'1' \(Scale\): scale"):
        gradhooks.add_hooks(model, unsupported="error")
    with gradhooks.add_hooks(model, unsupported="skip") as hooks:
        assert list(hooks.fallback_modules()) == []
        model(torch.randn(2, 3)).sum().backward()
    assert not hasattr(model[1].scale, "grad1")
    with pytest.raises(gradhooks.ConfigurationError, match="'fallback', 'error' or 'skip'"):
        gradhooks.add_hooks(model, unsupported="warn")


class Transposed(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):  # [batch, seq, n] -> [seq, batch, n]: batch not on dim 0
        return x.transpose(0, 1) * self.scale


def test_batch_not_on_dim_0_is_followed():
    """The module's output holds the batch on dimension 1: the fallback splits it there."""
    torch.manual_seed(0)
    model = Transposed(4).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    want = vmap_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(model.scale.grad1, want["scale"])


def test_mixing_examples_is_a_clear_error():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # training mode
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'1' \(BatchNorm1d\)"):
            model(torch.randn(5, 3)).sum().backward()


class Dropped(Scale):
    def forward(self, x):
        return F.dropout(super().forward(x), 0.5, self.training)


class DroppedProduct(nn.Module):
    """A custom layer whose weight meets the batch in a matrix product (the fallback's), then
    dropout."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return F.dropout(x @ self.w, 0.5, self.training)


def test_randomness_is_a_clear_error():
    model = DroppedProduct(4)
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'<model>' \(DroppedProduct\).*random"
        ):
            model(torch.randn(5, 4)).sum().backward()
    model.eval()
    check(
        Case("dropout_eval", lambda: DroppedProduct(4).eval(), lambda b: torch.randn(b, 4)), batch=3
    )


class NoSingleExamples(nn.Module):
    """A custom layer (its weight meets the batch in a matrix product: the fallback's) that
    refuses a batch of one, as the fallback's recomputation runs it."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        if x.shape[0] == 1:
            raise ValueError("this layer needs two examples at least")
        return x @ self.w


@pytest.mark.parametrize("batch_dim", ["auto", None])  # the tracker's split, or dimension 0
def test_a_failed_recomputation_is_a_clear_error(batch_dim):
    """The error names the module, the shapes and the layer's own complaint, and says what to
    do; the model is left as it was."""
    model = NoSingleExamples(4)
    with gradhooks.add_hooks(model, batch_dim=batch_dim):
        with pytest.raises(gradhooks.RuleError) as info:
            model(torch.randn(5, 4)).sum().backward()
    message = str(info.value)
    assert "'<model>' (NoSingleExamples) could not recompute the module one example" in message
    assert "inputs (5, 4)" in message and "needs two examples at least" in message
    where = "batch 5)" if batch_dim == "auto" else "batch 5 on dimension 0)"
    assert where in message  # (each of the two recomputations says where the batch is)
    assert "register a rule for it with @gradhooks.register" in message
    assert not hasattr(model.w, "grad1")
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_dropout_after_an_elementwise_weight_keeps_the_forwards_mask():
    """``dropout(tanh(x) * scale)`` in training: the scale's uses are followed (no
    recomputation), so each example's gradient is that of the mask the forward drew."""
    torch.manual_seed(0)
    model = Dropped(4).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(x)
        out.pow(2).sum().backward()
    kept = (out != 0).double() * 2.0  # the mask over 1 - p
    want = (2 * out * kept * torch.tanh(x)).sum(1)  # d/dscale of each example's Σ out²
    torch.testing.assert_close(model.scale.grad1, want)


@pytest.mark.parametrize("case", [CASES[3], CASES[8]], ids=repr)
def test_shared_tensor_whose_dim_0_equals_the_batch(case):
    """A mask [seq, seq] (or [seq, n]) with seq == batch is not split over the examples."""
    check(case, batch=3, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_outputs_computed_from_each_other(reduction):
    """An LSTMCell returns ``(h', c')`` with ``h'`` computed from ``c'``: the gradient reaching
    ``c'`` from outside the call is kept apart from what flows into it through ``h'`` (counted
    twice before). Against the per-example loop (``vmap`` cannot batch torch's LSTM cell)."""
    from harness import assert_close

    torch.manual_seed(0)
    model = CellPair().double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(out, target=None):
        return out.pow(2).sum()

    want = loop_grad(model, loss, x)
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        (loss(model(x)) / (4 if reduction == "mean" else 1)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


class ScaledEmbedding(nn.Embedding):
    """An Embedding that overrides forward (Hugging Face's ``*ScaledWordEmbedding``): no rule."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_modules_own_forward_hooks_do_not_run_in_the_recomputation(reduction):
    """A forward hook on a module the fallback recomputes, as Hugging Face's
    ``enable_input_require_grads`` adds (``output.requires_grad_(True)``, which torch.func
    refuses), and one that records outputs: the recomputation runs without them, and they run
    once per forward, as without gradhooks."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaledEmbedding(10, 4), nn.Linear(4, 3)).double()
    seen = []
    model[0].register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ids = torch.randint(0, 10, (4, 5))
    loss = lambda out: out.pow(2).sum()
    want = loop_grad(model, loss, ids)
    seen.clear()
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        loss(model(ids)).div(4 if reduction == "mean" else 1).backward()
    assert seen == [(4, 5, 4)]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[n])


class _SeqFirstAttention(nn.Module):
    """Attention over ``[time, batch, features]`` with a position table expanded to the batch
    (XLNet's relative attention): no rule, so the fallback."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, h, r):  # [T, B, n], [T, B, n]
        scores = torch.einsum("ibn,jbn->bij", h @ self.w, r)
        return torch.einsum("bij,jbn->ibn", scores.softmax(-1), h)


class _SeqFirstModel(nn.Module):
    def __init__(self, n=4, t=3):
        super().__init__()
        self.inp, self.pos = nn.Linear(n, n), nn.Embedding(t, n)
        self.attn, self.head = _SeqFirstAttention(n), nn.Linear(n, 2)

    def forward(self, x):  # [B, T, n]
        h = self.inp(x).transpose(0, 1)
        r = self.pos(torch.arange(x.shape[1]))[:, None].expand(-1, x.shape[0], -1)
        return self.head(self.attn(h, r).transpose(0, 1))


@pytest.mark.parametrize("batch", [2, 3, 5])  # (3: as long as the sequence)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sequence_first_module_with_an_expanded_position_input(batch, reduction):
    """The expanded position table holds the batch on dimension 1, where the module's other
    inputs hold the examples: the recomputation one example at a time splits it there."""
    torch.manual_seed(0)
    m = _SeqFirstModel().double()
    x = torch.randn(batch, 3, 4, dtype=torch.float64)

    def loss(out):
        return 0.5 * out.pow(2).sum() / (batch if reduction == "mean" else 1)

    want = vmap_grad(m, loss, x)
    with gradhooks.add_hooks(m, loss_reduction=reduction):
        loss(m(x)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad1, want[n] * (batch if reduction == "mean" else 1),
                                   rtol=1e-9, atol=1e-10, msg=n)  # fmt: skip


class _MaskedMixer(nn.Module):
    """Funnel's relative attention, in small: a per-example input, a type matrix built from
    a fresh tensor and expanded to the batch ``[B, T, T]``, and a ``[T, T]`` mask (no rule)."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n**0.5)
        self.type_bias = nn.Parameter(torch.randn(()))

    def forward(self, h, types, mask):  # [B, T, n], [B, T, T], [T, T]
        scores = torch.einsum("btn,bsn->bts", h @ self.w, h) + self.type_bias * types
        return torch.einsum("bts,bsn->btn", (scores - 1e4 * (1 - mask)).softmax(-1), h)


class _MaskedModel(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(n, n), _MaskedMixer(n), nn.Linear(n, 2)

    def forward(self, x):
        b, t, _ = x.shape
        kinds = torch.zeros(b, t, dtype=x.dtype)  # (no example's: made here)
        types = (kinds[:, :, None] == kinds[:, None, :]).to(x.dtype)
        mask = torch.ones(t, t, dtype=x.dtype).tril()
        return self.head(self.mix(self.inp(x), types, mask))


@pytest.mark.parametrize("batch", [2, 3])  # (3: the mask as long as the batch)
def test_an_expanded_input_and_a_mask_as_long_as_the_batch(batch):
    """Which inputs to split with the examples is told by the output check: the expanded
    type matrix may be, the ``[T, T]`` mask must not be, even when ``T`` is the batch size."""
    torch.manual_seed(0)
    m = _MaskedModel().double()
    x = torch.randn(batch, 3, 4, dtype=torch.float64)
    want = vmap_grad(m, lambda out: 0.5 * out.pow(2).sum(), x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        (0.5 * m(x).pow(2).sum()).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad1, want[n], rtol=1e-9, atol=1e-10, msg=n)


def test_the_per_example_loop_stacks_and_fills_missing_rows():
    """``gradhooks.loop.per_example``, the one loop every per-example recomputation runs
    through: rows stacked per position, an example's missing row zeros, a position no example
    gave ``None`` (or zeros where its shape is given), a batch of 0 empty."""
    import doctest

    import gradhooks.loop

    assert doctest.testmod(gradhooks.loop).failed == 0
    like = [torch.ones(2), None, torch.ones(3)]
    rows = gradhooks.loop.per_example(
        2, lambda b: [torch.full((2,), b + 1.0), None, None if b == 0 else torch.ones(3)], like
    )
    assert torch.equal(rows[0], torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    assert rows[1] is None
    assert torch.equal(rows[2], torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    empty = gradhooks.loop.per_example(0, lambda b: [], like)
    assert [t.shape if t is not None else None for t in empty] == [(0, 2), None, (0, 3)]


class Float32Inside(nn.Module):
    """A float64 module that computes in float32 inside (HY-V4's hyper-connections take
    ``.float()`` of their input), or, with ``mix``, also moves each example's rows to the
    next."""

    def __init__(self, mix=False):
        super().__init__()
        self.mix = mix
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        h = torch.sigmoid(F.linear(x.float(), self.w.float()))
        if self.mix:  # (each example's rows put into the next's: no reduction to see)
            idx = torch.where(h[:, 0] > -100)[0]
            h = torch.zeros_like(h).index_add_(0, (idx + 1) % h.shape[0], h[idx])
        return h * self.w.sum(0)  # (float64 again)


class WeightedExperts(nn.Module):
    """Rows ``[tokens, WIDTH]`` of float64 routed to an expert by an index, weighted by routing
    weights ``[tokens]`` of float32 (a router's float32 softmax) and summed in their dtype, as
    Nemotron-H's experts do."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, WIDTH, WIDTH) / WIDTH**0.5)  # (two experts)

    def forward(self, h, weights):
        out = torch.zeros_like(h, dtype=weights.dtype)
        idx = torch.where(weights > 0.3)[0]
        y = torch.tanh(F.linear(h[idx], self.w[0])) * weights[idx, None]
        return out.index_add_(0, idx, y.to(out.dtype)).to(h.dtype)


class _Routed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.router, self.inner = nn.Linear(WIDTH, 1), inner
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        if isinstance(self.inner, WeightedExperts):
            weights = torch.sigmoid(self.router(x).float())[:, 0]
            return self.head(self.inner(x, weights))
        return self.head(self.inner(x))


WIDTH = 64
# the float32 rounding of the module's computation, in grad1 and in the loop alike: 1e3 float32
# epsilons (relative to the parameter's largest entry)
FLOAT32 = {"rtol": 1e-4, "atol": 1e-6}


@pytest.mark.parametrize("inner", [Float32Inside, WeightedExperts])
def test_a_module_computing_in_float32_inside_a_float64_model(inner):
    """The recomputation one example at a time is compared with the forward's output within the
    rounding the module computed in: float32 inside (``.float()``), or a float32 input it sums
    in, and grad1 matches the loop at float32's tolerance. Before, the float64 output's
    rounding was required, and such a module was refused as mixing the examples where the
    recomputation rounded differently (the experts here by 3e-8; in the Hugging Face sweep
    Nemotron-H's experts by 2e-10, HY-V4's hyper-connections by 2e-11)."""
    torch.manual_seed(0)
    model = _Routed(inner()).double()
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    want = loop_grad(model, lambda out: 0.5 * out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (0.5 * model(x).pow(2).sum()).backward()
    for n, p in model.named_parameters():
        if p.grad is None:  # (the router, unused by Float32Inside)
            assert not hasattr(p, "grad1") and not want[n].any(), n
            continue
        scale = want[n].abs().max()
        torch.testing.assert_close(
            p.grad1, want[n], rtol=FLOAT32["rtol"], atol=FLOAT32["atol"] * float(scale), msg=n
        )


def test_a_module_mixing_the_examples_in_float32_inside_is_still_refused():
    torch.manual_seed(0)
    model = _Routed(Float32Inside(mix=True)).double()
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.GradhooksError,
            match="'inner.*(one example at a time does not reproduce|across the)",
        ):
            model(x).pow(2).sum().backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_the_recomputation_is_judged_by_the_rounding_the_module_computes_in():
    """A float64 module computing in float32 inside: its recomputation one example at a time
    may round differently from the batched forward (another float32 kernel for another
    shape, as HY-V4's hyper-connections did, by 2e-11 of float64 outputs near 1). A
    difference of that size is accepted (the module's forward, run once more under a mode
    that sees its operations, computes in float32); one of 1e-2 is still refused, and so is
    a difference of 1e-9 in a module computing in float64 throughout."""
    from gradhooks.rules.fallback import _compare
    from gradhooks.rules.registry import Call

    torch.manual_seed(0)
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    for module, noise, accepted in [
        (Float32Inside().double(), 1e-9, True),
        (Float32Inside().double(), 1e-2, False),
        (Scale(WIDTH).double(), 1e-9, False),
    ]:
        with torch.no_grad():
            want = module(x)
        call = Call(module, (x,), {}, want, (torch.ones_like(want),), name="inner")
        got = want + noise * torch.randn_like(want).sign()
        if accepted:
            _compare("'inner'", call, 0, got, want, 7)
        else:
            with pytest.raises(gradhooks.MixedExamplesError, match="does not reproduce"):
                _compare("'inner'", call, 0, got, want, 7)


class MovesItsExperts(nn.Module):
    """Soft mixture of experts that moves its experts where they already are on every call
    (``expert.to(device)``, as soft-moe-pytorch does), with slot embeddings of its own: the
    fallback recomputes it, and ``.to`` sets each expert parameter's ``.data`` to itself."""

    def __init__(self, n=4, experts=2):
        super().__init__()
        self.slots = nn.Parameter(torch.randn(experts, n))
        self.experts = nn.ModuleList([nn.Linear(n, n) for _ in range(experts)])

    def forward(self, x):  # [batch, seq, n]
        for expert in self.experts:
            expert.to(x.device)
        weights = torch.einsum("bsn,en->bse", x, self.slots).softmax(1)
        slots = torch.einsum("bsn,bse->ebn", x, weights)
        out = torch.stack([expert(s) for expert, s in zip(self.experts, slots)])
        return torch.einsum("ebn,bse->bsn", out, weights)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_module_that_moves_its_submodules_in_its_forward(reduction):
    """Under torch.func, the assignment ``.to`` makes to each parameter's ``.data`` crashed the
    process (torch 2.13); the recomputation runs one example at a time by autograd instead.
    Against the loop only: ``vmap_grad`` runs the same forward under torch.func."""
    torch.manual_seed(0)
    model = MovesItsExperts().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.pow(2).sum(), (x,))
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        losses = model(x).pow(2).flatten(1).sum(1)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], msg=name)


class MaskedByData(nn.Conv2d):
    """A convolution that masks its weight in place through ``.data`` at every forward
    (jzbontar/pixelcnn-pytorch's ``MaskedConv2d``): a layer without a rule, which torch.func
    cannot run (it raises at the write, once the write is done)."""

    def __init__(self):
        super().__init__(2, 3, 3, padding=1, bias=False)
        self.register_buffer("mask", torch.ones_like(self.weight))
        self.mask[:, :, 1, 2:] = 0
        self.mask[:, :, 2:] = 0

    def forward(self, x):
        self.weight.data *= self.mask
        return super().forward(x)


def test_a_layer_writing_its_weight_through_data_matches():
    """Its fallback recomputes it on a view of the weight with a version counter of its own.
    (Once the first recomputation, by torch.func, wrote through ``.data`` before raising, the
    write counted as a change of the weight the forward's graph saved, and the user's backward
    failed: "modified by an inplace operation".)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), MaskedByData(), nn.Flatten(), nn.Linear(48, 2))
    model = model.double()
    x = torch.randn(3, 1, 4, 4, dtype=torch.double)
    want = loop_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        model(x).pow(2).sum().backward()
    assert [name for name, _ in hooks.fallback_modules()] == ["1"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-10, msg=name)

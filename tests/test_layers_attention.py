"""nn.MultiheadAttention (every option) and the Transformer layers built from it, vs both oracles."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.pieces import Direct, Outer
from harness import Case, assert_close, check


@dataclass(frozen=True)
class Opts:
    """One configuration of a MultiheadAttention call. ``inputs``: ``"self"`` (query is key is
    value), ``"cross"`` (a separate key = value tensor of length ``src``) or ``"qkv"`` (three
    tensors; needed for ``kdim``/``vdim``). ``attn_mask``: ``"2d"`` / ``"3d"`` / ``"causal"``
    (a 2-D causal mask with ``is_causal=True``); masks are bool or float per ``mask_dtype``."""

    heads: int = 2
    head_dim: int = 2
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    batch_first: bool = True
    inputs: str = "self"
    tgt: int = 3
    src: int = 4
    key_padding_mask: bool = False
    attn_mask: str | None = None
    mask_dtype: str = "bool"
    need_weights: bool = True
    average_attn_weights: bool = True
    dropout: float = 0.0
    eval: bool = False

    @property
    def embed_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def src_len(self) -> int:
        return self.tgt if self.inputs == "self" else self.src

    def __str__(self) -> str:
        default = Opts()
        return ",".join(f"{k}={v}" for k, v in vars(self).items() if getattr(default, k) != v)


def random_mask(shape, dtype: str, causal: bool = False) -> torch.Tensor:
    """A mask (True / -inf = masked) that leaves the first key visible to every query."""
    if causal:
        masked = torch.ones(shape[-2:], dtype=torch.bool).triu(1)
    else:
        masked = torch.rand(shape) < 0.4
        masked[..., 0] = False
    if dtype == "bool":
        return masked
    values = torch.zeros(shape) if causal else torch.randn(shape)
    return values.masked_fill(masked, float("-inf"))


class Attend(nn.Module):
    """Batch-first inputs ``(query, [key/value...], [key_padding_mask], [attn_mask 3-D as
    [batch, heads, tgt, src]])``, so that the oracles can split them per example; calls the
    MultiheadAttention in its own layout and returns ``(output batch first, weights)``."""

    def __init__(self, o: Opts):
        super().__init__()
        self.o = o
        self.mha = nn.MultiheadAttention(
            o.embed_dim, o.heads, dropout=o.dropout, bias=o.bias, add_bias_kv=o.add_bias_kv,
            add_zero_attn=o.add_zero_attn, kdim=o.kdim, vdim=o.vdim, batch_first=o.batch_first,
        )  # fmt: skip
        if o.attn_mask in ("2d", "causal"):
            mask = random_mask((o.tgt, o.src_len), o.mask_dtype, causal=o.attn_mask == "causal")
            self.register_buffer("attn_mask", mask)
        if o.eval:
            self.eval()

    def forward(self, query, *rest):
        o = self.o
        rest = list(rest)
        if o.inputs == "self":
            key = value = query
        elif o.inputs == "cross":
            key = value = rest.pop(0)
        else:
            key, value = rest.pop(0), rest.pop(0)
        kwargs = {}
        if o.key_padding_mask:
            kwargs["key_padding_mask"] = rest.pop(0)
        if o.attn_mask == "3d":
            kwargs["attn_mask"] = rearrange(rest.pop(0), "b h t s -> (b h) t s")
        elif o.attn_mask:
            kwargs["attn_mask"] = self.attn_mask
            kwargs["is_causal"] = o.attn_mask == "causal"
        if not o.batch_first:  # keep `query is key` when it was
            t = {id(x): x.transpose(0, 1) for x in (query, key, value)}
            query, key, value = t[id(query)], t[id(key)], t[id(value)]
        out, weights = self.mha(
            query, key, value, need_weights=o.need_weights,
            average_attn_weights=o.average_attn_weights, **kwargs,
        )  # fmt: skip
        return (out if o.batch_first else out.transpose(0, 1)), weights


def attention_inputs(o: Opts, batch: int) -> tuple[torch.Tensor, ...]:
    e = o.embed_dim
    xs = [torch.randn(batch, o.tgt, e)]
    if o.inputs == "cross":
        xs.append(torch.randn(batch, o.src, e))
    elif o.inputs == "qkv":
        xs.append(torch.randn(batch, o.src, o.kdim or e))
        xs.append(torch.randn(batch, o.src, o.vdim or e))
    if o.key_padding_mask:
        xs.append(random_mask((batch, o.src_len), o.mask_dtype))
    if o.attn_mask == "3d":
        xs.append(random_mask((batch, o.heads, o.tgt, o.src_len), o.mask_dtype))
    return tuple(xs)


def case(o: Opts) -> Case:
    return Case(str(o) or "default", lambda: Attend(o), lambda b: attention_inputs(o, b))


NAMED = {
    "self": Opts(),
    "cross": Opts(inputs="cross", tgt=3, src=5),
    "kdim_vdim": Opts(inputs="qkv", kdim=3, vdim=5, tgt=4, src=2),
    "no_bias": Opts(bias=False, inputs="cross"),
    "bias_kv_zero_attn": Opts(add_bias_kv=True, add_zero_attn=True, inputs="cross"),
    "seq_first_masks": Opts(batch_first=False, key_padding_mask=True, attn_mask="3d"),
    "float_masks": Opts(key_padding_mask=True, attn_mask="2d", mask_dtype="float"),
    "causal_sdpa": Opts(attn_mask="causal", need_weights=False, add_bias_kv=True),
    "causal_hint_ignored": Opts(attn_mask="causal", key_padding_mask=True, add_bias_kv=True),
    "per_head_weights": Opts(average_attn_weights=False, heads=3, inputs="cross"),
    "eval_with_dropout": Opts(dropout=0.5, eval=True),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("name", NAMED)
def test_named_configurations(name, batch, reduction):
    check(case(NAMED[name]), batch=batch, reduction=reduction)


@settings(max_examples=30)
@given(
    heads=st.integers(1, 3),
    head_dim=st.integers(1, 3),
    inputs=st.sampled_from(["self", "cross", "qkv"]),
    kdim_vdim=st.sampled_from([(None, None), (2, 2), (3, 5), (None, 4)]),
    bias=st.booleans(),
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    batch_first=st.booleans(),
    lengths=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    key_padding_mask=st.booleans(),
    attn_mask=st.sampled_from([None, "2d", "3d", "causal"]),
    mask_dtype=st.sampled_from(["bool", "float"]),
    weights=st.sampled_from(["none", "averaged", "per_head"]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_hypothesis_sweep(
    heads, head_dim, inputs, kdim_vdim, bias, add_bias_kv, add_zero_attn, batch_first, lengths,
    key_padding_mask, attn_mask, mask_dtype, weights, reduction,
):  # fmt: skip
    kdim, vdim = kdim_vdim if inputs == "qkv" else (None, None)
    o = Opts(
        heads=heads, head_dim=head_dim, kdim=kdim, vdim=vdim, bias=bias, add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn, batch_first=batch_first, inputs=inputs, tgt=lengths[0],
        src=lengths[1], key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        mask_dtype=mask_dtype, need_weights=weights != "none",
        average_attn_weights=weights == "averaged",
    )  # fmt: skip
    check(case(o), batch=3, reduction=reduction)


def test_check_rule():
    o = NAMED["bias_kv_zero_attn"]
    report = gradhooks.check_rule(Attend(o), attention_inputs(o, 3))
    assert report.ok and any("bias_k" in k for k in report.differences), str(report)


def test_pieces_are_outer_products():
    """The projections give Outer pieces (norms, K-FAC come for free); bias_k/bias_v Direct."""
    m = nn.MultiheadAttention(4, 2, add_bias_kv=True, batch_first=True)
    x, kv = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    seen = {}
    rule = gradhooks.REGISTRY.lookup(m).rule
    reg = gradhooks.Registry()
    reg.register(nn.MultiheadAttention, owns_children=True)(
        lambda call: seen.setdefault("p", rule(call))
    )
    with gradhooks.add_hooks(m, registry=reg):
        m(x, kv, kv)[0].sum().backward()
    pieces = seen["p"]
    assert set(pieces) == {n for n, _ in m.named_parameters()}
    for name in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"):
        assert isinstance(pieces[name], Outer), name
    assert isinstance(pieces["bias_k"], Direct) and isinstance(pieces["bias_v"], Direct)


def test_loss_on_attention_weights_only():
    """The gradient of the returned weights is honoured, also when none reaches the output.
    The output projection, which the weights do not depend on, gets no ``.grad`` from
    autograd, and no ``grad1`` either (its per-example gradients are zeros: the oracle's)."""
    o = replace(NAMED["cross"], average_attn_weights=False)
    torch.manual_seed(0)
    model = Attend(o).double()
    xs = tuple(x.double() for x in attention_inputs(o, 3))
    loss = lambda out: (out[1] ** 3).sum()  # noqa: E731
    want = gradhooks.oracle.vmap_grad(model, loss, xs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(*xs)).backward()
    for name, p in model.named_parameters():
        if "out_proj" in name:
            assert p.grad is None and not hasattr(p, "grad1") and not want[name].any(), name
        else:
            assert torch.allclose(p.grad1, want[name], rtol=1e-7, atol=1e-9), name
    assert model.mha.in_proj_weight.grad1.abs().max() > 0


def test_dropout_in_training_is_an_error():
    """Refused at the forward, which draws the mask."""
    m = nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True)
    x = torch.randn(2, 3, 4)
    with gradhooks.add_hooks(m):
        with pytest.raises(gradhooks.UnsupportedError):
            m(x, x, x)


def test_unbatched_input_is_an_error():
    m = nn.MultiheadAttention(4, 2)
    x = torch.randn(3, 4)
    with gradhooks.add_hooks(m):
        out = m(x, x, x)[0].sum()
        with pytest.raises(
            gradhooks.UnbatchedInputError, match=r"unbatched query of shape \(3, 4\)"
        ):
            out.backward()


# -- Transformer layers -----------------------------------------------------------------------


@pytest.fixture
def registry():
    return gradhooks.REGISTRY


class Layer(nn.Module):
    """A Transformer(Encoder|Decoder)Layer fed batch-first inputs (``src`` or ``(tgt, memory)``
    and, optionally, key padding masks), with a causal self-attention mask."""

    def __init__(
        self, kind: str, batch_first: bool, norm_first: bool, activation: str, masks: bool
    ):
        super().__init__()
        cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
        self.layer = cls(
            6, 2, dim_feedforward=5, dropout=0.0, activation=activation,
            batch_first=batch_first, norm_first=norm_first,
        )  # fmt: skip
        self.kind, self.batch_first, self.masks = kind, batch_first, masks

    def forward(self, x, *rest):
        tb = (lambda t: t) if self.batch_first else (lambda t: t.transpose(0, 1))
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        if self.kind == "encoder":
            kpm = {"src_key_padding_mask": rest[0]} if self.masks else {}
            out = self.layer(tb(x), src_mask=causal, is_causal=True, **kpm)
        else:
            memory, *kpms = rest
            kpm = dict(zip(("tgt_key_padding_mask", "memory_key_padding_mask"), kpms, strict=False))
            out = self.layer(tb(x), tb(memory), tgt_mask=causal, tgt_is_causal=True, **kpm)
        return tb(out)


def layer_inputs(kind: str, masks: bool, batch: int):
    xs = [torch.randn(batch, 4, 6)]
    if kind == "decoder":
        xs.append(torch.randn(batch, 3, 6))
    if masks:
        xs.append(random_mask((batch, 4), "float"))
        if kind == "decoder":
            xs.append(random_mask((batch, 3), "float"))
    return tuple(xs)


# Every value of each option at least once, both layouts with each norm placement (pairwise).
LAYER_OPTIONS = [
    pytest.param(True, True, "relu", id="batch_first-pre_norm-relu"),
    pytest.param(True, False, "gelu", id="batch_first-post_norm-gelu"),
    pytest.param(False, True, "gelu", id="seq_first-pre_norm-gelu"),
    pytest.param(False, False, "relu", id="seq_first-post_norm-relu"),
]


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize(("batch_first", "norm_first", "activation"), LAYER_OPTIONS)
def test_transformer_layers(registry, kind, batch_first, norm_first, activation):
    masks = activation == "gelu"  # key padding masks on half the cases
    c = Case(
        f"{kind}-{batch_first}-{norm_first}-{activation}",
        lambda: Layer(kind, batch_first, norm_first, activation, masks),
        lambda b: layer_inputs(kind, masks, b),
    )
    # torch's own forward fails on an empty batch with a key padding mask: batch 0 without masks.
    for batch, reduction in ((3, "mean"), (1, "sum"), (0 if not masks else 2, "mean")):
        check(c, batch=batch, reduction=reduction, registry=registry)


def test_transformer_layer_in_eval_mode_takes_the_normal_path(registry):
    """In eval mode with hooks (grad enabled, parameters requiring grad) torch does not take
    its fused fast path, so the rule sees the normal computation."""
    c = Case(
        "encoder-eval",
        lambda: Layer("encoder", True, False, "relu", False).eval(),
        lambda b: layer_inputs("encoder", False, b),
    )
    check(c, batch=3, reduction="mean", registry=registry)


def test_transformer_encoder_stack(registry):
    """nn.TransformerEncoder: deep copies of one layer, sequence first. (No final ``norm=``: a
    LayerNorm outside the layers would see [seq, batch, E], and its rule reads dim 0 as batch.)"""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, x):
            return self.encoder(x.transpose(0, 1)).transpose(0, 1)

    check(
        Case("encoder-stack", Encoder, lambda b: torch.randn(b, 3, 4)),
        batch=3,
        reduction="sum",
        registry=registry,
    )


def test_transformer_layer_hands_its_parts_to_the_handles_registry():
    """The layer's parts get the rules of the registry given to add_hooks, not the default's:
    a registry whose Linear rule is wrapped sees every Linear part's call, and grad1 still
    matches the loop (sequence-first, so the parts' calls are put batch first)."""
    seen = []
    reg = gradhooks.Registry()
    for m in (nn.TransformerEncoderLayer(4, 2), nn.LayerNorm(2), nn.MultiheadAttention(4, 2)):
        entry = gradhooks.REGISTRY.lookup(m)
        reg.register(type(m), owns_children=entry.owns_children, batch_dim=entry.batch_dim,
                     taps=entry.taps, needs_output=entry.needs_output)(entry.rule)  # fmt: skip
    linear = gradhooks.REGISTRY.lookup(nn.Linear(1, 1)).rule
    reg.register(nn.Linear)(lambda call: seen.append(call.name) or linear(call))
    c = Case("encoder-own-registry", lambda: Layer("encoder", False, False, "relu", False),
             lambda b: layer_inputs("encoder", False, b))  # fmt: skip
    check(c, batch=3, reduction="mean", registry=reg)
    assert {"layer.linear1", "layer.linear2"} <= set(seen)


def test_transformer_layer_dropout_in_training_is_an_error():
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.1)
    with gradhooks.add_hooks(layer, unsupported="skip"):
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"training mode with dropout > 0 \(dropout, dropout1"
        ):
            layer(torch.randn(3, 2, 4))  # (refused at the forward, which draws the masks)


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_taps_the_projections(batch_first, monkeypatch):
    """Stock self-attention gives the rule the in-projection's output-gradient from the
    backward itself (no recompute); a backward for out_proj's weight alone never reaches the
    in-projection, and the rule then recomputes at its end."""
    from gradhooks.rules import attention

    torch.manual_seed(0)
    model = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # batch 3 (batch_first) or 5

    def loss_fn(out):
        return out[0].pow(2).sum()

    def one(params, xi):
        xi = xi.unsqueeze(0 if batch_first else 1)
        return loss_fn(
            torch.func.functional_call(model, params, (xi, xi, xi), {"need_weights": False})
        )

    params = {n: p.detach() for n, p in model.named_parameters()}
    want = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0 if batch_first else 1))(params, x)
    calls = []
    tapped = attention._tapped_pieces
    monkeypatch.setattr(attention, "_tapped_pieces", lambda *a: calls.append(1) or tapped(*a))
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        loss_fn(model(x, x, x, need_weights=False)).backward()
        assert calls, "the taps were not used"
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
        h.clear()
        calls.clear()
        torch.autograd.grad(loss_fn(model(x, x, x, need_weights=False)), [model.out_proj.weight])
        assert not calls
        assert_close(model.out_proj.weight.grad1, want["out_proj.weight"], "out_proj alone")
        for args, kwargs in (
            ((x,), {"key": x, "value": x}),
            ((), {"query": x, "key": x, "value": x}),
        ):
            h.clear()
            calls.clear()
            loss_fn(model(*args, **kwargs, need_weights=False)).backward()
            assert calls, f"the taps were not used, called with {len(args)} positional"
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{n}, {len(args)} positional")


class AdaptedAttention(nn.Module):
    """A trainable parameter inside a self-attention's module tree (as PEFT puts its LoRA
    matrices there) that the model uses before the attention call, not inside it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.attn.adapter = nn.Module()
        self.attn.adapter.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = x * self.attn.adapter.scale
        return self.attn(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize("frozen", [True, False], ids=["adapter-only", "all-trainable"])
def test_a_parameter_of_the_attention_used_outside_its_call(frozen):
    """With the in-projection run detached (every call: the threshold at 1), what the engine
    reads of the parameters as the call starts is not the call's use of them: the adapter's
    grad1 comes from where the model uses it. Against the per-example loop, in float64."""
    torch.manual_seed(0)
    model = AdaptedAttention().double().eval()
    if frozen:
        for n, p in model.attn.named_parameters():
            p.requires_grad_(n.startswith("adapter."))
    x = torch.randn(3, 5, 8, dtype=torch.double)
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    want = loop_grad(model, loss_fn, x)
    with gradhooks.tuned(sum_grad1_positions=1):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            loss_fn(model(x)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad1, want[n], n)
            assert_close(p.grad, want[n].sum(0), f"{n} .grad")


def test_a_hook_reading_a_parameters_metadata_does_not_use_it():
    """A forward pre-hook of the user's that reads a parameter's dtype as the attention's call
    starts (inside the call, for the tracker) does not make it a parameter the call used: its
    grad1 still comes from where the model uses it. Short sequences: nothing run detached."""
    torch.manual_seed(0)
    model = AdaptedAttention().double().eval()
    x = torch.randn(3, 5, 8, dtype=torch.double)
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    want = loop_grad(model, loss_fn, x)
    seen = []
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.attn.register_forward_pre_hook(
            lambda m, args: seen.append((m.adapter.scale.dtype, m.adapter.scale.requires_grad))
        )
        loss_fn(model(x)).backward()
    assert seen == [(torch.double, True)]
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)

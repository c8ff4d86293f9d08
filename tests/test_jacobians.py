"""Per-example Jacobians on real call signatures, against ``vmap(jacrev)`` of
``torch.func.functional_call`` in float64: parameters used outside their modules' calls (a tied
head ``F.linear(h, self.emb.weight)``, a table read directly, a parameter used by its module and
by its parent), several positional and keyword inputs, tiny Hugging Face GPT-2 and BERT with
padded attention masks, bfloat16 autocast; outputs without the batch on dimension 0 refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from harness import Logits, assert_close, hf

D = torch.float64


def vmap_jacrev(model, args, kwargs=None, batch=None, loop=False):
    """``{name: [batch, *out, *p.shape]}``: ``jacrev`` of one example's output (a batch of one
    through ``functional_call``), ``vmap``-ed over the inputs with ``batch`` rows on dimension
    0; the others are shared by every example. ``loop``: one example at a time instead of
    ``vmap`` (Hugging Face's attention masks branch on the mask's values)."""
    kwargs = kwargs or {}
    batch = args[0].shape[0] if batch is None else batch
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    per = lambda t: isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
    keys = list(kwargs)
    values = [kwargs[k] for k in keys]

    def one(xs, vs):
        xs = tuple(x[None] if per(a) else a for x, a in zip(xs, args))
        kw = {k: v[None] if per(kwargs[k]) else v for k, v in zip(keys, vs)}
        call = lambda p: torch.func.functional_call(model, (p, buffers), xs, kw)[0]
        return torch.func.jacrev(call)(params)

    dims = ([0 if per(a) else None for a in args], [0 if per(v) else None for v in values])
    with gradhooks.paused():
        if not loop:
            return torch.vmap(one, in_dims=tuple(dims))(list(args), values)
        rows = [
            one([a[b] if per(a) else a for a in args], [v[b] if per(v) else v for v in values])
            for b in range(batch)
        ]
        return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}


def check(model, args, kwargs=None, what="", loop=False):
    """Every trainable parameter's Jacobian, and the flattened one, against vmap(jacrev)."""
    args = args if isinstance(args, tuple) else (args,)
    want = vmap_jacrev(model, args, kwargs, loop=loop)
    extra = {} if kwargs is None else {"kwargs": kwargs}  # (the old call, without)
    got = gradhooks.jacobians(model, args if len(args) > 1 else args[0], **extra)
    assert set(got) == set(want), f"{what}: {sorted(got)} != {sorted(want)}"
    batch = args[0].shape[0]
    for name, w in want.items():
        g = got[name]
        assert g.shape[:1] == (batch,) and g.shape[2:] == dict(model.named_parameters())[name].shape
        assert_close(g.reshape(w.shape), w, f"{what}: Jacobian of {name}")
    flat = gradhooks.jacobians(model, args if len(args) > 1 else args[0], **extra, flatten=True)
    outputs = flat.shape[1]
    assert_close(
        flat, torch.cat([w.reshape(batch, outputs, -1) for w in want.values()], -1), f"{what} flat"
    )


# -- parameters used outside their modules' calls ------------------------------------------------


class TiedHead(nn.Module):
    """GPT-2-style weight tying in the functional form: ``logits = F.linear(h, emb.weight)``."""

    def __init__(self, vocab=7, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens))).mean(1)
        return F.linear(h, self.emb.weight)


class NanoTied(nn.Module):
    """nanoGPT's tying: ``self.lm_head.weight = self.wte.weight``, logits at every position."""

    def __init__(self, vocab=7, dim=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.wte(tokens)))


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class ParentMatmul(nn.Module):
    """A parameter of the model itself, used as ``x @ self.W``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.W = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.tanh(self.fc(x)) @ self.W


class TableRead(nn.Module):
    """A position table read as ``self.pos.weight[:T]``, outside the Embedding's call."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.pos = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens) + self.pos.weight[: tokens.shape[1]]).mean(1))


class PositionCall(nn.Module):
    """A position embedding called on ``arange(T)`` alone, broadcast into the batch later."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.pos = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        positions = self.pos(torch.arange(tokens.shape[1]))
        return self.head(torch.tanh(self.emb(tokens) + positions).mean(1))


class UsedInAndOut(nn.Module):
    """A bias used by its Linear and again by the parent: ``fc(x) * fc.bias.sum()``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) * self.fc.bias.sum()


def tokens():
    return torch.randint(7, (3, 5), generator=torch.Generator().manual_seed(1))


def features():
    return torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "make, inputs",
    [
        (TiedHead, tokens),
        (NanoTied, tokens),
        (CalledTwice, features),
        (ParentMatmul, features),
        (TableRead, tokens),
        (PositionCall, tokens),
        (UsedInAndOut, features),
    ],
    ids=["tied_head_f_linear", "nanogpt_tie", "called_twice", "parent_matmul", "table_read",
         "position_call", "used_in_and_out"],
)  # fmt: skip
def test_every_use_of_a_parameter_counts(make, inputs):
    torch.manual_seed(0)
    check(make().double(), inputs(), what=make.__name__)


def test_a_frozen_parameter_is_left_out():
    torch.manual_seed(0)
    model = TiedHead().double()
    model.mix.weight.requires_grad_(False)
    got = gradhooks.jacobians(model, tokens())
    assert "mix.weight" not in got
    want = vmap_jacrev(model, (tokens(),))
    assert_close(got["emb.weight"], want["emb.weight"], "frozen neighbour")


def test_a_model_with_every_parameter_frozen():
    model = nn.Linear(3, 2).requires_grad_(False)
    assert gradhooks.jacobians(model, torch.randn(4, 3)) == {}
    assert gradhooks.jacobians(model, torch.randn(4, 3), flatten=True).shape == (4, 2, 0)


# -- several inputs, keyword inputs --------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(2, 5)

    def forward(self, x, y, scale=1.0, mask=None):
        out = scale * torch.tanh(self.a(x) + self.b(y))
        return out if mask is None else out * mask


def test_several_inputs_and_keyword_arguments():
    torch.manual_seed(0)
    model = TwoInputs().double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 4, dtype=D, generator=g), torch.randn(3, 2, dtype=D, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).to(D)
    check(model, (x, y), {"scale": 2.0}, "scale")
    check(model, (x, y), {"scale": 0.5, "mask": mask}, "per-example mask")
    shared = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0], dtype=D)  # every example's
    check(model, (x, y), {"mask": shared}, "shared mask")
    # the same call with the keyword inputs positional, as a list
    got = gradhooks.jacobians(model, [x, y, 2.0, mask])
    want = gradhooks.jacobians(model, (x, y), kwargs={"scale": 2.0, "mask": mask})
    for name in want:
        assert_close(got[name], want[name], f"positional {name}")


def test_the_old_signature_still_works():
    torch.manual_seed(0)
    model = CalledTwice().double()
    x = features()
    assert_close(
        gradhooks.jacobians(model, x)["shared.weight"],
        gradhooks.jacobians(model, (x,), kwargs={})["shared.weight"],
        "one tensor, a tuple of one",
    )


# -- outputs without the batch on dimension 0 ----------------------------------------------------


class Reduced(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.how = how

    def forward(self, x):
        out = self.fc(x)
        return {
            "scalar": lambda: out.sum(),
            "sum0": lambda: out.sum(0),
            "transposed": lambda: out.T,
            "centred": lambda: out - out.mean(0),
            "dict": lambda: {"logits": out},
            "parameter_only": lambda: self.fc.weight.sum(1) + 0 * out.sum(),
        }[self.how]()


@pytest.mark.parametrize(
    "how, says",
    [
        ("scalar", r"output \(\) for a batch of 3 .* scalar"),
        ("sum0", r"output \(\(3,\)\) mixes the 3 examples"),
        ("transposed", r"output \(3, 3\) .* examples are on dimension 1"),
        ("centred", r"output \(\(3, 3\)\) mixes the 3 examples"),
        ("dict", r"returned a dict, not a tensor"),
    ],
)
def test_an_output_without_the_batch_is_refused(how, says):
    model = Reduced(how).double()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(gradhooks.GradhooksError, match=says):
        gradhooks.jacobians(model, features())
    # (nothing left on the model)
    with pytest.raises(gradhooks.ConfigurationError, match="no gradhooks hooks"):
        gradhooks.hooks_of(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_a_hooked_model_is_refused():
    model = CalledTwice().double()
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.StateError, match="already"):
        gradhooks.jacobians(model, features())


# -- bfloat16 autocast -----------------------------------------------------------------------


class OverPositions(nn.Module):
    """Linears on ``[batch, positions, features]``, a LayerNorm, a mean over positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.fc(x)))).mean(1)


@pytest.mark.parametrize(
    "make, inputs",
    [
        (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
         lambda: torch.randn(4, 6)),
        (OverPositions, lambda: torch.randn(4, 5, 6)),
        (TiedHead, lambda: torch.randint(7, (4, 5))),
    ],
    ids=["mlp", "positions_layer_norm", "tied_head"],
)  # fmt: skip
def test_bfloat16_autocast(make, inputs):
    """Under CPU autocast to bfloat16 the Linears compute in bfloat16 (8 significant bits):
    the Jacobians, in the parameters' float32, are within 3% of the largest entry of the
    float64 ones of the same weights (each entry is a product of two or three bfloat16-rounded
    factors, about 0.4% each, summed over 8 hidden units; 0.9% seen). Convolutions under
    autocast are not covered: their Jacobian rule fails there (oneDNN refuses the mixed
    dtypes)."""
    torch.manual_seed(0)
    model, x = make(), inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradhooks.jacobians(model, x)
    want = vmap_jacrev(model.double(), (x.double() if x.is_floating_point() else x,))
    for name, w in want.items():
        g = got[name]
        assert g.dtype == torch.float32, f"{name}: {g.dtype}"
        scale = w.abs().max().item()
        torch.testing.assert_close(
            g.double().reshape(w.shape),
            w,
            rtol=0,
            atol=3e-2 * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )


# -- Hugging Face models -----------------------------------------------------------------------


def test_the_docstrings_examples_run():
    import doctest
    import importlib

    module = importlib.import_module("gradhooks.workflows.jacobian")
    result = doctest.testmod(module)
    assert result.attempted >= 8 and result.failed == 0, result


V = 12


def padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(V, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding (GPT-2 reads the last position)
    mask[2, :1] = 0
    return ids, mask


def test_gpt2_tied_lm_head_with_padding_mask():
    """GPT-2's lm_head is tied to the token embeddings (a Linear sharing ``wte.weight``), its
    position embedding is called on positions alone, its Conv1D layers use ``torch.addmm``:
    all summed into each parameter's Jacobian, against vmap(jacrev), with a padded mask."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=V, n_positions=8,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    torch.manual_seed(0)
    model = Logits(hf("GPT2LMHeadModel")(cfg)).double().eval()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    ids, mask = padded_batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        check(model, (ids,), {"attention_mask": mask}, "GPT-2", loop=True)


def test_bert_classifier_with_padding_mask():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=12, vocab_size=V, max_position_embeddings=8,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = Logits(hf("BertForSequenceClassification")(cfg), last=False).double().eval()
    ids, mask = padded_batch()
    mask = mask.flip(1)  # right padding
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        check(model, (ids,), {"attention_mask": mask}, "BERT", loop=True)

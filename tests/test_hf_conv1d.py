"""Hugging Face's ``Conv1D`` (GPT-2's layers: ``torch.addmm(b, x, W)``, ``W`` ``[in, out]``) by
its own rule, registered by name: found for that class and a subclass that keeps its forward,
never for a subclass with a forward of its own or another class of the same name; every
quantity against the float64 oracles (``vmap(grad)`` and the per-example loop), alone and in a
tiny GPT-2 with a padding mask, under bfloat16 autocast, over DP training steps and under a
PEFT LoRA adapter."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from gradhooks.rules.hf_conv1d import CONV1D, conv1d
from harness import Case, check, hf

transformers = pytest.importorskip("transformers", reason="needs transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

D = torch.float64
V = 40  # vocabulary


# -- which classes the rule covers ----------------------------------------------------------------


def test_importing_gradhooks_does_not_import_transformers():
    code = "import sys, gradhooks; assert 'transformers' not in sys.modules, 'imported'"
    root = Path(gradhooks.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_rule_is_found_by_the_class_name():
    assert CONV1D in gradhooks.REGISTRY.names()
    assert f"{Conv1D.__module__}.{Conv1D.__qualname__}" == CONV1D
    assert gradhooks.REGISTRY.lookup(Conv1D(3, 2)).rule is conv1d
    assert gradhooks.is_supported(Conv1D(3, 2))


class Kept(Conv1D):
    """A subclass that keeps Conv1D's forward: it inherits the rule."""


class Scaled(Conv1D):
    """A subclass with a forward of its own (the rule's product would be wrong by 2)."""

    def forward(self, x):
        return 2 * super().forward(x)


class Copied(Conv1D):
    """A subclass whose forward is a copy of Conv1D's: not Conv1D's own function, so the rule is
    not assumed; the fallback follows its ``torch.addmm`` (the function's rule)."""

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class _Named(nn.Module):
    """Another class that takes Conv1D's name (``__module__`` and ``__qualname__``), and
    computes ``x W`` with ``W`` ``[out, in]`` and no bias."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nf, nx) / nx**0.5)

    def forward(self, x):
        return x @ self.weight.T


Impostor = type("Conv1D", (_Named,), {"__module__": "transformers.pytorch_utils"})
Impostor.__qualname__ = "Conv1D"


@pytest.mark.parametrize("cls,ruled", [(Conv1D, True), (Kept, True), (Scaled, False),
                                       (Copied, False), (Impostor, False)],
                         ids=["conv1d", "kept", "scaled", "copied", "namesake"])  # fmt: skip
def test_subclasses_and_namesakes(cls, ruled):
    """The rule where the class is Conv1D or keeps its forward (as for nn.Linear's
    subclasses); otherwise the fallback, and grad1 right either way."""
    entry = gradhooks.REGISTRY.lookup(cls(5, 4))
    assert entry is (gradhooks.REGISTRY.lookup(Conv1D(1, 1)) if ruled else None)
    case = Case(cls.__qualname__, lambda: _Head(cls(5, 4), 15), lambda b: torch.randn(b, 3, 4))
    for reduction in ("mean", "sum"):
        check(case, batch=4, reduction=reduction)
    with gradhooks.add_hooks(_Head(cls(5, 4), 15)) as h:
        assert bool(list(h.fallback_modules())) != ruled


def test_a_copy_of_the_forward_goes_through_the_addmm_function_rule(monkeypatch):
    """A module without a rule that hands its parameters to ``torch.addmm``: the function's
    rule (shared with Conv1D's) gives their pieces, not a torch.func recomputation."""
    entry = gradhooks.REGISTRY.function("addmm")[0]
    seen = []

    def spy(call):
        seen.append(call.name)
        return rule(call)

    rule = entry.rule
    monkeypatch.setattr(entry, "rule", spy)
    case = Case("copied", lambda: _Head(Copied(5, 4), 15), lambda b: torch.randn(b, 3, 4))
    check(case, batch=3, reduction="sum")
    assert seen and all("used in addmm" in name for name in seen), seen


class _Head(nn.Module):
    """A layer on ``[batch, *, 4]``, flattened, tanh, a Linear to 3."""

    def __init__(self, layer, features):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(features, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.layer(x).flatten(1)))


# -- the layer alone -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 4])
@pytest.mark.parametrize("shape", [(), (3,), (2, 3)], ids=["rows", "seq", "grid"])
def test_conv1d_alone(shape, batch, reduction):
    """``[batch, *shape, in]``: grad1 against vmap(grad) and the loop, .grad its sum."""
    positions = int(torch.tensor(shape).prod()) if shape else 1
    case = Case(
        f"conv1d{shape}", lambda: _Head(Conv1D(5, 4), 5 * positions),
        lambda b: torch.randn(b, *shape, 4),
    )  # fmt: skip
    check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize("detached", [False, True], ids=["autograd", "detached"])
@pytest.mark.parametrize("quantities", [("grad1",), ("norms",)])
def test_batch_gradient_from_the_pieces(quantities, detached):
    """Past ``TUNING.sum_grad1_positions`` positions (here forced to 1) the call runs with its
    parameters detached, as Linear's does: autograd's graph holds no product of its own for
    them (it never forms their batch gradient), and ``.grad`` comes from the pieces; the norms
    are the ghost (Gram) norms, never a recomputation."""
    torch.manual_seed(0)
    model = Conv1D(16, 16).double()  # (3 positions of 16 features: the Gram form is cheaper)
    x = torch.randn(4, 3, 16, dtype=D)
    loss = lambda out: 0.5 * (out**2).sum()  # noqa: E731
    want = loop_grad(model, loss, x)
    threshold = 1 if detached else 10**9
    with gradhooks.tuned(sum_grad1_positions=threshold):
        with gradhooks.add_hooks(model, "sum", quantities=quantities) as h:
            out = model(x)
            # (detached on the CPU alone: gradhooks.devices.cpu_trade_offs)
            detached_here = detached and gradhooks.devices.cpu_trade_offs(x)
            assert ("AddmmBackward0" in _nodes(out)) != detached_here
            loss(out).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n].sum(0), msg=n)
        if "grad1" in quantities:
            torch.testing.assert_close(p.grad1, want[n], msg=n)
    if "norms" in quantities:
        norms = h.param_norms()
        for n in want:
            torch.testing.assert_close(norms[n], want[n].flatten(1).norm(dim=1), msg=n)
        assert h.norm_forms()["weight"] == "gram"


def _nodes(t: torch.Tensor) -> list[str]:
    """The types of the nodes of ``t``'s graph."""
    found, todo = [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            found.append(type(node).__name__)
            todo.extend(n for n, _ in node.next_functions)
    return found


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
def test_complex_input():
    """A complex layer: mat2's gradient is mat1ᴴ g, as the loop computes it."""
    torch.manual_seed(0)
    layer = Conv1D(3, 4).to(torch.complex128)
    x = torch.randn(5, 2, 4, dtype=torch.complex128)
    loss = lambda out: (out.abs() ** 2).sum()  # noqa: E731
    want = loop_grad(layer, loss, x)
    with gradhooks.add_hooks(layer, "sum"):
        loss(layer(x)).backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad1, want[n], msg=n)


# -- a tiny GPT-2 ----------------------------------------------------------------------------------


class LM(nn.Module):
    """A tiny GPT-2 (eager attention: vmap-able), its logits ``[batch, seq, vocab]``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        cfg = hf("GPT2Config")(n_embd=16, n_layer=2, n_head=2, vocab_size=V, n_positions=32,
                               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        self.model = hf("GPT2LMHeadModel")(cfg)

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits


def token_loss(logits, target):
    """Next-token cross-entropy summed over the positions that are not padding (-100)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                           reduction="sum")  # fmt: skip


def padded_batch(size: int = 4, seq: int = 6, seed: int = 0):
    """Token ids, an attention mask with left padding (2, 0, 1, 3 positions) and targets
    ignoring the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (size, seq), generator=g)
    mask = torch.ones_like(ids)
    for b, pad in enumerate((2, 0, 1, 3)[:size]):
        mask[b, :pad] = 0
    target = torch.randint(V, (size, seq), generator=g).masked_fill(mask == 0, -100)
    return ids, mask, target


def _conv1d_covered(h, model):
    """Every Conv1D by its rule: none by the fallback."""
    convs = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(convs) == 8
    assert not [n for n, _ in h.fallback_modules() if n in convs]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_padding_against_vmap_and_loop(reduction):
    """grad1, .grad, the norms and the squared sums of every parameter, with a padding mask."""
    model = LM().double().eval()
    ids, mask, target = padded_batch()
    want = vmap_grad(model, token_loss, (ids, mask), target)
    loop = loop_grad(model, token_loss, (ids, mask), target)
    quantities = ("grad1", "norms", "sum_grad_sq")
    with gradhooks.add_hooks(model, reduction, quantities=quantities) as h:
        loss = token_loss(model(ids, mask), target)
        (loss / ids.shape[0] if reduction == "mean" else loss).backward()
        _conv1d_covered(h, model)
        norms, sums, forms = h.param_norms(), h.sum_grad_sq(), h.norm_forms()
    for n, p in model.named_parameters():
        torch.testing.assert_close(loop[n], want[n], msg=f"loop vs vmap {n}")
        torch.testing.assert_close(p.grad1, want[n], msg=n)
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        torch.testing.assert_close(reduced, p.grad, msg=f".grad {n}")
        torch.testing.assert_close(norms[n], want[n].flatten(1).norm(dim=1), msg=f"norm {n}")
        torch.testing.assert_close(sums[n], want[n].pow(2).sum(0), msg=f"sum_grad_sq {n}")
    assert forms["model.transformer.h.0.attn.c_attn.weight"] in ("gram", "materialized")


def test_gpt2_bfloat16_autocast():
    """Under CPU bfloat16 autocast (float32 parameters), with a padding mask: grad1 against the
    float64 loop, to 5e-2 of the larger of the parameter's own largest entry and 1% of the
    model's. bfloat16 keeps 8 significant bits (a unit of 2⁻⁹ ≈ 2e-3); the output-gradients
    come through two blocks of bfloat16 products, a few units each, summed over 6 positions
    whose errors do not cancel: ~16 units, as tests/test_autocast.py argues. A wrong piece (a
    transposed product, another example's rows, a lost scale) is off by ~1."""
    model = LM().eval()
    ids, mask, target = padded_batch()
    ref = loop_grad(copy.deepcopy(model).double(), token_loss, (ids, mask), target)
    overall = max(float(r.abs().max()) for r in ref.values())
    with gradhooks.add_hooks(model, "sum", quantities=("grad1", "norms")) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, mask)
        token_loss(logits.float(), target).backward()
        _conv1d_covered(h, model)
        norms = h.param_norms()
    for n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32, n
        scale = max(float(ref[n].abs().max()), 1e-2 * overall)
        err = float((p.grad1.double() - ref[n]).abs().max()) / scale
        assert err <= 5e-2, f"{n}: relative error {err:.2e}"
        want = ref[n].flatten(1).norm(dim=1)
        err = float((norms[n].double() - want).abs().max()) / max(float(want.max()), 1e-2)
        assert err <= 5e-2, f"norm of {n}: relative error {err:.2e}"


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "bookkeeping, detached"])
def test_gpt2_dp_training_steps(method):
    """Three DP-SGD steps (clipping, no noise) of a hooked GPT-2 and of an unhooked twin that
    takes the loop's clipped sum: at each step ``.grad`` and then the parameters agree.
    "detached": every Conv1D and the tied head counted large (``unused_grad_macs``), so that
    from the second step on they run detached."""
    if method.endswith("detached"):
        method = "bookkeeping"
        reach = gradhooks.tuned(unused_grad_macs=1, unused_grad_macs_device=1)
    else:
        reach = contextlib.nullcontext()
    with reach:
        _gpt2_dp_training_steps(method)


def _gpt2_dp_training_steps(method: str) -> None:
    model = LM().double().eval()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    C = 0.5
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(3):
            ids, mask, target = padded_batch(seed=step)
            opt.zero_grad()
            logits = model(ids, mask)
            losses = torch.stack([token_loss(logits[i : i + 1], target[i : i + 1])
                                  for i in range(ids.shape[0])])  # fmt: skip
            norms = gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0)
            per = loop_grad(twin, token_loss, (ids, mask), target)
            total = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
            torch.testing.assert_close(norms, total, msg=f"step {step}: norms")
            factor = (C / total).clamp(max=1.0)
            twin_opt.zero_grad()
            for n, p in twin.named_parameters():
                p.grad = (per[n] * factor.view(-1, *[1] * (per[n].dim() - 1))).mean(0)
            for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: .grad of {n}")
            opt.step()
            twin_opt.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, msg=n)


@pytest.mark.parametrize("bias", ["none", "all"])
def test_gpt2_lora_on_c_attn(bias):
    """A PEFT LoRA adapter on ``c_attn`` (``fan_in_fan_out=True``: the adapter wraps the
    Conv1D, calls it, and adds its own two Linears): the adapters' grad1, and with
    ``bias="all"`` the Conv1D biases' (their weights frozen) by the Conv1D rule, against the
    loop, with a padding mask."""
    peft = pytest.importorskip("peft", reason="needs peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                             fan_in_fan_out=True, bias=bias)  # fmt: skip
    model = peft.get_peft_model(LM(), config).double().eval()
    with torch.no_grad():  # (lora_B starts at zero: move off it)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable)
    assert any(n.endswith("c_attn.base_layer.bias") for n in trainable) == (bias == "all")
    ids, mask, target = padded_batch()
    want = loop_grad(model, token_loss, (ids, mask), target)
    with gradhooks.add_hooks(model, "sum") as h:
        token_loss(model(ids, mask), target).backward()
        fallback = [n for n, _ in h.fallback_modules()]
    assert not [n for n in fallback if "c_attn" in n], fallback
    for n in trainable:
        p = model.get_parameter(n)
        torch.testing.assert_close(p.grad1, want[n], msg=n)
        torch.testing.assert_close(p.grad1.sum(0), p.grad, msg=f".grad {n}")

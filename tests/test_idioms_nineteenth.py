"""Training-loop idioms, a nineteenth set: the training loops of real, widely used scripts.

Each test writes again, with a tiny model and in gradhooks' terms, the loop of a script read on
GitHub (its repository and path in the docstring): litgpt's ``finetune/adapter.py`` on Lightning
Fabric (the LLaMA-Adapter prompt built from an embedding's weight through a frozen projection,
only the adapter trained, ``no_backward_sync`` accumulation, an lm head called on chunks, in
float64 and ``bf16-true``; and adapter v2's scaled and shifted frozen Linears and RMSNorms);
microsoft/LoRA's GPT-2 E2E fine-tuning (loralib's ``MergedLinear``, label smoothing under a
token mask, a schedule stepped per micro-batch, LoRA's dropout refused, and in float16 under a
``GradScaler``; and its DP fork's per-parameter clipping); lucidrains' denoising-diffusion
``Trainer1D`` (the loss inside the hooked module, self-conditioning by a ``no_grad`` forward of
the same network, accelerate's ``autocast`` in bfloat16); pytorch/examples' ``mnist_hogwild``
(the hooked model's weights in shared memory, trained by forked processes);
karpathy/build-nanogpt's ``train_gpt2.py`` (the head tied the other way round, bfloat16
autocast, fused AdamW in decay groups, the clip's returned norm); diffusers' textual inversion
(one new token's embedding trained through a frozen bfloat16 UNet, the other rows written back
after every step); transformers' ``Trainer`` accumulating with ``num_items_in_batch`` (the loss
over the token count of the whole step);
accelerate's ``find_executable_batch_size`` (a step that runs out of memory in the forward or
the backward, retried with a smaller batch); nanochat's ``base_train.py`` (rotary tables in
bfloat16, QK norm, a soft-capped head, the embedding in bfloat16, Muon writing into ``.grad``)
and ``chat_rl.py`` (per-token log-probabilities from the model, weighted by each sample's
advantage, over the valid tokens of every pass).

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in float64 or within the rounding of
the precision the script runs in, or checked to stop with a typed error that names what went
wrong."""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_eighteenth import BF16, clipped, norms_of, relative_error
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    assert_untouched,
    labelled_batch,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
)

D = torch.float64
STEPS = 3


def fabric_of(precision: str):
    """A one-device CPU ``lightning.fabric.Fabric`` of ``precision``, or a skip where Lightning
    is not installed."""
    pytest.importorskip("lightning", reason="Lightning is not installed")
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1, precision=precision)


# -- Lightning-AI/litgpt finetune/adapter.py: LLaMA-Adapter on Fabric ---------------------------


class AdapterAttention(nn.Module):
    """litgpt ``litgpt/adapter.py``'s ``CausalSelfAttention``, shrunk: causal attention by
    ``scaled_dot_product_attention`` and, from the adapter's first layer on, an attention of
    every query over an adaption prompt, the weight of ``adapter_wte`` (an ``nn.Embedding``
    whose forward is never called) reshaped to one ``[1, prompt, dim]`` sequence and run
    through the layer's own frozen ``qkv``, its keys and values broadcast over the batch and
    gated per head by ``gating_factor`` (zeros at first: the zero-init attention)."""

    def __init__(self, dim: int, heads: int, prompt: int, linear=nn.Linear) -> None:
        super().__init__()
        self.heads, self.prompt = heads, prompt
        self.qkv, self.proj = linear(dim, 3 * dim), linear(dim, dim)
        if prompt:
            self.adapter_wte = nn.Embedding(prompt, dim)
            self.gating_factor = nn.Parameter(torch.zeros(1, 1, heads, 1))

    def heads_of(self, qkv: torch.Tensor):
        """``[B, T, 3 * dim]`` to q, k and v, each ``[B, heads, T, head size]``."""
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.heads_of(self.qkv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.prompt:
            prefix = self.adapter_wte.weight.reshape(1, self.prompt, C)
            _, ak, av = self.heads_of(self.qkv(prefix))
            amask = torch.ones(T, self.prompt, dtype=torch.bool)
            ay = F.scaled_dot_product_attention(q, ak, av, attn_mask=amask).transpose(1, 2)
            y = y + self.gating_factor * ay
        return self.proj(y.reshape(B, T, C))


class AdapterV2Linear(nn.Module):
    """litgpt ``litgpt/adapter_v2.py``'s ``AdapterV2Linear``: a frozen ``nn.Linear`` whose
    output is shifted by ``adapter_bias`` and scaled by ``adapter_scale``, both used by the
    wrapper's own forward."""

    def __init__(self, features: int, out: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out, bias=bias)
        self.adapter_bias = nn.Parameter(torch.zeros(out), requires_grad=False)
        self.adapter_scale = nn.Parameter(torch.ones(out), requires_grad=False)

    def forward(self, x):
        return self.adapter_scale * (self.linear(x) + self.adapter_bias)


class RMSNorm(nn.Module):
    """litgpt ``litgpt/model.py``'s ``RMSNorm``: computed in float32 (``x.float()``, which in a
    float64 model rounds to float32), scaled by its ``weight``, cast back."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x_normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return (x_normed * self.weight.float()).to(dtype=dtype)


class AdapterBlock(nn.Module):
    """A pre-norm block: the attention above and a GELU MLP, each residual (adapter v2: every
    Linear an ``AdapterV2Linear``, the norms litgpt's ``RMSNorm``)."""

    def __init__(self, dim: int, heads: int, prompt: int, v2: bool = False) -> None:
        super().__init__()
        linear, norm = (AdapterV2Linear, RMSNorm) if v2 else (nn.Linear, nn.LayerNorm)
        self.norm_1, self.attn = norm(dim), AdapterAttention(dim, heads, prompt, linear)
        self.norm_2 = norm(dim)
        self.mlp = nn.Sequential(linear(dim, 2 * dim), nn.GELU(), linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class AdapterGPT(nn.Module):
    """litgpt's adapter ``GPT``: two blocks, the adapter from the second
    (``adapter_start_layer=1``); ``lm_head_chunk_size`` returns the head's logits of each chunk
    of the sequence, the head called once per chunk. With ``v2``, adapter v2's."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 2, v2: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(AdapterBlock(dim, heads, 3 * (i >= 1), v2) for i in range(2))
        self.ln_f = RMSNorm(dim) if v2 else nn.LayerNorm(dim)
        self.lm_head = (AdapterV2Linear if v2 else nn.Linear)(dim, vocab, bias=False)

    def forward(self, idx, lm_head_chunk_size: int = 0):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if lm_head_chunk_size:
            return [self.lm_head(c) for c in x.split(lm_head_chunk_size, 1)]
        return self.lm_head(x)


def chunked_cross_entropy(logits: list, targets: torch.Tensor) -> torch.Tensor:
    """litgpt ``litgpt/utils.py``'s ``chunked_cross_entropy`` given the head's chunks: each
    chunk's unreduced token losses (``ignore_index=-100``), their sum over the count of targets
    not ignored in the whole batch."""
    size = logits[0].shape[1]
    losses = [
        F.cross_entropy(lc.flatten(0, 1), tc.flatten(), ignore_index=-100, reduction="none")
        for lc, tc in zip(logits, targets.split(size, 1), strict=True)
    ]
    count = (targets != -100).sum()
    return torch.cat(losses).sum() / count.maximum(torch.ones_like(count))


def instruction_batch(g: torch.Generator, n: int = 4, length: int = 7, vocab: int = 11):
    """An Alpaca-like batch: token ids padded with 0 to ``length``, labels the same tokens
    with each example's prompt (its first 2 or 3) and padding set to -100."""
    ids = torch.randint(1, vocab, (n, length), generator=g)
    lengths = torch.randint(5, length + 1, (n,), generator=g)
    prompts = torch.randint(2, 4, (n,), generator=g)
    where = torch.arange(length)
    ids = ids.masked_fill(where >= lengths[:, None], 0)
    labels = ids.masked_fill((where < prompts[:, None]) | (where >= lengths[:, None]), -100)
    return ids, labels


ADAPTER_V2 = ("adapter_scale", "adapter_bias", "norm_1", "norm_2", "ln_f")


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
@pytest.mark.parametrize("version", ["adapter", "adapter_v2"])
def test_litgpt_adapter_finetuning_on_fabric_with_the_prompt_from_an_embeddings_weight(
    version, precision,
):  # fmt: skip
    """Lightning-AI/litgpt ``litgpt/finetune/adapter.py`` (``fit``) over ``litgpt/adapter.py``:
    ``mark_only_adapter_as_trainable`` (``adapter_wte`` and ``gating_factor`` alone), Fabric at
    ``precision`` (``"bf16-true"``, the script's default, converts the model to bfloat16),
    two micro-batches per step under ``fabric.no_backward_sync(model,
    enabled=is_accumulating)``, ``logits = model(input_ids, lm_head_chunk_size=4)``, the last
    chunk cut by one position, ``fabric.backward(chunked_cross_entropy(logits,
    targets[..., 1:]) / 2)``, then AdamW's step, ``zero_grad`` and a warm-up scheduler's step.
    The adaption prompt reaches the batch only through a frozen layer called on the weight
    itself. At every micro-batch grad1 (summed over the step's micro-batches, as ``.grad``)
    and the norms (each backward's own) are the float64 loop's, each example's token losses
    over the batch's count of targets: exactly in float64, within bfloat16's rounding of each
    parameter's largest entry in bfloat16. At the first step the prompt's grad1 is exactly
    zero, as its gradient is (the gate is zero). ``finetune/adapter_v2.py`` over
    ``litgpt/adapter_v2.py`` trains as well every ``AdapterV2Linear``'s scale and shift (the
    ``qkv`` one used on the batch and on the batch-free prompt in the same forward) and the
    ``RMSNorm`` weights: there float64's tolerance is float32's (litgpt's ``RMSNorm``
    computes in float32)."""
    fabric = fabric_of(precision)
    v2 = version == "adapter_v2"
    model = AdapterGPT(v2=v2)
    trainable = ("adapter_wte", "gating_factor") + (ADAPTER_V2 if v2 else ())
    for n, p in model.named_parameters():
        p.requires_grad = any(key in n for key in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Fabric's notes about the CPU)
        wrapped, opt = fabric.setup(model, opt)
    dtype = torch.bfloat16 if precision == "bf16-true" else D
    assert model.h[1].attn.gating_factor.dtype == dtype
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    accum, g = 2, torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(wrapped, quantities=("grad1", "norms"), loss_reduction="sum") as h:
        want: dict = {}
        for it in range(1, 2 * STEPS + 1):
            input_ids, targets = instruction_batch(g)
            shifted = targets[..., 1:]
            count = (shifted != -100).sum()

            def own_loss(logits, t, count=count):
                """Example's token losses over the batch's count, over the micro-batches."""
                t = t[..., 1:]
                ce = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1), t.flatten(), ignore_index=-100,
                    reduction="sum",
                )  # fmt: skip
                return ce / count / accum

            mine = loop_grad(copy.deepcopy(model).to(D), own_loss, input_ids, targets)
            want = {} if it % accum == 1 else want
            want = {n: want.get(n, 0) + mine[n] for n in mine}
            is_accumulating = it % accum != 0
            with fabric.no_backward_sync(wrapped, enabled=is_accumulating):
                logits = wrapped(input_ids, lm_head_chunk_size=4)
                logits[-1] = logits[-1][..., :-1, :]
                fabric.backward(chunked_cross_entropy(logits, shifted) / accum)
            if precision == "64-true" and not v2:
                assert_grad1(model, want, f"micro-batch {it}", frozen_clean=True)
                assert_close(h.norms(), norms_of(mine), f"micro-batch {it}: norms")
            else:
                tol = BF16 if precision == "bf16-true" else 1e-5
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        assert p.grad1.dtype == dtype, n
                        err = relative_error(p.grad1, want[n])
                        assert err < tol, f"micro-batch {it}: {n} off by {err:.2e}"
                    else:
                        assert not hasattr(p, "grad1"), n
                err = relative_error(h.norms(), norms_of(mine))
                assert err < tol, f"micro-batch {it}: norms off by {err:.2e}"
            if it <= accum:
                assert not model.h[1].attn.adapter_wte.weight.grad1.any()
            if not is_accumulating:
                opt.step()
                opt.zero_grad()
                scheduler.step()
    assert model.h[1].attn.adapter_wte.weight.grad is None  # (after zero_grad: None)


# -- microsoft/LoRA examples/NLG: loralib's MergedLinear in a GPT-2 -------------------------------


class MergedLinear(nn.Linear):
    """microsoft/LoRA ``loralib/layers.py``'s ``MergedLinear`` as the NLG example builds GPT-2's
    ``c_attn`` (``fan_in_fan_out=True``: the weight ``[in, out]``, ``merge_weights=False``):
    an ``nn.Linear`` subclass whose own forward adds, to the frozen projection, LoRA updates
    of the query and value thirds only (``enable_lora=[True, False, True]``): ``lora_A`` by
    ``F.linear`` after dropout, ``lora_B`` by a grouped ``F.conv1d`` over the sequence, put in
    place by ``zero_pad`` (an index assignment of the enabled columns into zeros)."""

    def __init__(self, features: int, out: int, r: int, alpha: float, enable_lora, dropout):
        nn.Linear.__init__(self, features, out)
        self.r, self.scaling, self.enable_lora = r, alpha / r, enable_lora
        self.lora_dropout = nn.Dropout(dropout)
        k = sum(enable_lora)
        self.lora_A = nn.Parameter(self.weight.new_zeros((r * k, features)))
        self.lora_B = nn.Parameter(self.weight.new_zeros((out // len(enable_lora) * k, r)))
        self.weight.requires_grad = False
        index = self.weight.new_zeros((out,), dtype=torch.bool).view(len(enable_lora), -1)
        index[enable_lora, :] = True
        self.lora_ind = index.view(-1)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.normal_(self.lora_B, std=0.2)  # (zeros in the script: no gradient to lora_A)
        self.weight.data = self.weight.data.transpose(0, 1)

    def zero_pad(self, x):
        result = x.new_zeros((*x.shape[:-1], self.out_features)).view(-1, self.out_features)
        width = self.out_features // len(self.enable_lora) * sum(self.enable_lora)
        result[:, self.lora_ind] = x.reshape(-1, width)
        return result.view((*x.shape[:-1], self.out_features))

    def forward(self, x):
        result = F.linear(x, self.weight.transpose(0, 1), bias=self.bias)
        after_A = F.linear(self.lora_dropout(x), self.lora_A)
        after_B = F.conv1d(
            after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1), groups=sum(self.enable_lora)
        ).transpose(-2, -1)
        result += self.zero_pad(after_B) * self.scaling
        return result


class Conv1D(nn.Module):
    """The example's ``Conv1D`` (GPT-2's): ``torch.addmm`` of the bias and the rows of ``x``
    by a ``[in, out]`` weight."""

    def __init__(self, out: int, features: int) -> None:
        super().__init__()
        self.out = out
        self.weight = nn.Parameter(torch.randn(features, out) * 0.2)
        self.bias = nn.Parameter(torch.zeros(out))

    def forward(self, x):
        size = x.shape[:-1] + (self.out,)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*size)


class LoraGPT2(nn.Module):
    """The example's ``GPT2LMModel`` shrunk to one block: token and position embeddings (the
    positions ``expand_as`` the ids), masked attention whose ``c_attn`` is the
    ``MergedLinear``, a GELU MLP of ``Conv1D``s, the head tied to the token embedding;
    ``forward`` returns ``(lm_logits, presents)``."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 2, length: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn = MergedLinear(dim, 3 * dim, 2, 4.0, [True, False, True], 0.1)
        self.c_proj, self.c_fc, self.mlp_proj = (
            Conv1D(dim, dim),
            Conv1D(4 * dim, dim),
            Conv1D(dim, 4 * dim),
        )
        self.register_buffer(
            "bias", torch.tril(torch.ones(length, length)).view(1, 1, length, length)
        )
        self.decoder = nn.Linear(dim, vocab, bias=False)
        self.decoder.weight = self.wte.weight

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        b = self.bias[:, :, :T, :T]
        w = F.softmax(w * b + -1e10 * (1 - b), dim=-1)
        return self.c_proj(torch.matmul(w, v).transpose(1, 2).reshape(B, T, C))

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.size(-1)).unsqueeze(0).expand_as(input_ids)
        h = self.wte(input_ids) + self.wpe(position_ids)
        h = h + self.attention(self.ln_1(h))
        h = h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h))))
        return self.decoder(self.ln_f(h)), None


def smoothed_lm_loss(lm_logits, lm_labels, lm_mask, label_smooth: float = 0.1):
    """The example's ``GPT2LMModel`` loss: label-smoothed token losses times ``lm_mask``,
    per token ``[batch, len]``."""
    logprobs = F.log_softmax(lm_logits.view(-1, lm_logits.size(-1)), dim=-1)
    nll_loss = -logprobs.gather(dim=-1, index=lm_labels.view(-1).unsqueeze(1)).squeeze(1)
    smooth_loss = -logprobs.mean(dim=-1)
    loss = (1.0 - label_smooth) * nll_loss + label_smooth * smooth_loss
    return loss.view(lm_labels.shape) * lm_mask


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("fp16", [False, True], ids=["float64", "fp16"])
def test_loralib_gpt2_e2e_finetuning_with_label_smoothing_and_a_per_micro_batch_schedule(fp16):
    """microsoft/LoRA ``examples/NLG/src/gpt2_ft.py`` (``train_validate``, ``optimizer_step``)
    over ``examples/NLG/src/model.py`` and ``loralib/layers.py``: ``lora.
    mark_only_lora_as_trainable(model)``, ``_lm_loss`` the label-smoothed (0.1) token losses
    times ``lm_mask`` summed over ``lm_mask.sum() + 0.0001``, its backward over ``grad_acc=2``,
    on each second micro-batch ``clip_grad_norm_`` and AdamW's step and ``zero_grad``, the
    linear warm-up schedule stepped at every micro-batch (as the script does); ``model.eval()``
    and a validation pass under ``torch.no_grad()`` after the second step. With ``--fp16``
    (apex's ``amp.scale_loss``, here float16 autocast and ``GradScaler("cpu")``:
    ``scaler.scale(loss).backward()``, then ``unscale_``, the clipping, ``scaler.step`` and
    ``update``) the model is float32. With the README's ``--lora_dropout 0.1`` the first
    backward is refused (an ``UnsupportedError`` naming ``c_attn``, the ``MergedLinear``: its
    forward draws random numbers, which no per-example recomputation reproduces) and leaves
    the model as it was; the loop then runs with LoRA's dropout at 0. At every micro-batch
    grad1 of ``lora_A`` and ``lora_B`` (summed over the step's micro-batches, as ``.grad``) is
    the float64 loop's of each example's masked token losses over the batch's mask sum:
    exactly in float64; over the scale in force, within float16's rounding (1e-2 of each
    parameter's largest entry) with ``--fp16``. The frozen weights (the tied embedding, the
    ``Conv1D``s) have none."""
    dtype = torch.float32 if fp16 else D
    model = LoraGPT2().to(dtype)
    for n, p in model.named_parameters():
        p.requires_grad = "lora_" in n
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(trained) == 2
    opt = torch.optim.AdamW(trained, lr=0.02, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=fp16)
    grad_acc, g = 2, torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        ids, labels = torch.randint(11, (5, 8), generator=g), torch.randint(11, (5, 8), generator=g)
        before = model_state(model)
        with autocast:
            lm_logits, _ = model(ids)
        loss = smoothed_lm_loss(lm_logits.to(dtype), labels, torch.ones(5, 8, dtype=dtype))
        raised(
            gradhooks.UnsupportedError, ["'c_attn'", "MergedLinear"],
            lambda: scaler.scale(loss.mean()).backward(),
        )  # fmt: skip
        assert_untouched(model, before)
        model.c_attn.lora_dropout.p = 0.0
        want: dict = {}
        for train_step in range(1, 2 * STEPS + 1):
            model.train()
            ids = torch.randint(11, (5, 8), generator=g)
            labels = torch.randint(11, (5, 8), generator=g)
            mask = (torch.rand(5, 8, generator=g) < 0.7).to(dtype)
            total = mask.sum() + 0.0001
            exact = mask.to(D).sum() + 0.0001

            def own(out, target, total=exact):
                y, m = target.unbind(-1)
                return smoothed_lm_loss(out[0], y.long(), m).sum() / total / grad_acc

            target = torch.stack((labels.to(D), mask.to(D)), -1)
            mine = loop_grad(copy.deepcopy(model).to(D), own, ids, target)
            want = {} if train_step % grad_acc == 1 else want
            want = {n: want.get(n, 0) + mine[n] for n in mine}
            with autocast:
                lm_logits, _ = model(ids)
            _lm_loss = smoothed_lm_loss(lm_logits.to(dtype), labels, mask).sum() / total
            scale = scaler.get_scale() if fp16 else 1.0
            scaler.scale(_lm_loss.mean() / grad_acc).backward()
            if fp16:
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        assert p.grad1.dtype == torch.float32, n
                        err = relative_error(p.grad1 / scale, want[n])
                        assert err < 1e-2, f"micro-batch {train_step}: {n} off by {err:.2e}"
                    else:
                        assert not hasattr(p, "grad1"), n
            else:
                assert_grad1(model, want, f"micro-batch {train_step}", frozen_clean=True)
            if train_step % grad_acc == 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            schedule.step()
            if train_step == 4:
                model.eval()
                with torch.no_grad():
                    model(torch.randint(11, (3, 8), generator=g))


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_loralib_gpt2_dp_fine_tuning_clipped_per_parameter(method):
    """huseyinatahaninan/Differentially-Private-Fine-tuning-of-Language-Models
    ``Language-Generation-GPT-2/src/gpt2_ft.py`` and ``src/model.py``: microsoft/LoRA's E2E
    loop made private (Opacus with a grad sampler written for loralib's ``MergedLinear``),
    each sequence's loss its masked, label-smoothed token losses over its own
    ``lm_mask.sum(-1) + 0.0001``, ``max_grad_norm = [C / sqrt(n_layers)] * n_layers`` over the
    ``n_layers = 2`` trainable LoRA parameters (``clipping_groups="parameter"``: each clipped
    to ``C/√2``), the clipped sum over the batch, AdamW. Here ``dp_sgd_step`` without noise:
    at each of three steps the norms and ``.grad`` are the float64 loop's per-parameter
    clipped mean, with grad1 and by book-keeping (the ``MergedLinear``'s pieces come from
    gradhooks' fallback: no rule knows it), and the frozen weights get no gradient; ghost
    clipping, one factor per example for the whole model, refuses the groups (a
    ``ConfigurationError``) and writes nothing."""
    model = LoraGPT2().to(D)
    for n, p in model.named_parameters():
        p.requires_grad = "lora_" in n
    model.c_attn.lora_dropout.p = 0.0
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([model.get_parameter(n) for n in trained], lr=0.02)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    bound = 0.05 / math.sqrt(len(trained))
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            ids, labels = (
                torch.randint(11, (5, 8), generator=g),
                torch.randint(11, (5, 8), generator=g),
            )
            mask = (torch.rand(5, 8, generator=g) < 0.7).to(D)

            def own(out, target):
                y, m = target.unbind(-1)
                return smoothed_lm_loss(out[0], y.long(), m).sum() / (m.sum() + 0.0001)

            want = loop_grad(model, own, ids, torch.stack((labels.to(D), mask), -1))
            opt.zero_grad()
            lm_logits, _ = model(ids)
            loss = smoothed_lm_loss(lm_logits, labels, mask).sum(-1) / (mask.sum(-1) + 0.0001)
            step_it = functools.partial(
                gradhooks.dp_sgd_step, h, loss, max_norm=0.05, noise_multiplier=0.0,
                method=method, clipping_groups="parameter",
            )  # fmt: skip
            if method == "ghost":  # (one factor per example for all parameters)
                raised(gradhooks.ConfigurationError, ["ghost", "2 clipping groups"], step_it)
                assert all(p.grad is None for p in model.parameters())
                return
            norms = step_it()
            assert_close(norms, norms_of(want), f"step {step}: norms")
            acted = False
            for n, p in model.named_parameters():
                if n not in want:
                    assert p.grad is None, n
                    continue
                own_norms = want[n].flatten(1).norm(dim=1)
                acted |= bool((own_norms > bound).any())
                assert_close(p.grad, clipped({n: want[n]}, bound)[n], f"step {step}: {n}")
            assert acted, "the clipping must act for the test to tell"
            opt.step()


# -- lucidrains/denoising-diffusion-pytorch: self-conditioning inside the loss --------------------


class TimeUnet1D(nn.Module):
    """lucidrains ``denoising_diffusion_pytorch_1d.py``'s ``Unet1D``, shrunk to one resnet
    block: the self-condition (zeros when not given) concatenated before the input on the
    channels, the sinusoidal embedding of each example's timestep through an MLP into a scale
    and shift of the block's GroupNorm output, a residual 1x1 convolution."""

    def __init__(self, channels: int = 2, dim: int = 8, self_condition: bool = True) -> None:
        super().__init__()
        self.self_condition, self.dim = self_condition, dim
        inputs = channels * (2 if self_condition else 1)
        self.init_conv = nn.Conv1d(inputs, dim, 3, padding=1)
        self.time_mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, 2 * dim)
        )
        self.block = nn.Conv1d(dim, dim, 3, padding=1)
        self.norm = nn.GroupNorm(2, dim)
        self.final_conv = nn.Conv1d(dim, channels, 1)

    def time_embedding(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``SinusoidalPosEmb``: ``[sin, cos]`` of ``t`` at ``dim / 2`` frequencies."""
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, dtype=dtype) * -(math.log(10000) / (half - 1)))
        angles = t[:, None].to(dtype) * freqs[None]
        return torch.cat((angles.sin(), angles.cos()), dim=-1)

    def forward(self, x, time, x_self_cond=None):
        if self.self_condition:
            x_self_cond = torch.zeros_like(x) if x_self_cond is None else x_self_cond
            x = torch.cat((x_self_cond, x), dim=1)
        h = self.init_conv(x)
        scale, shift = self.time_mlp(self.time_embedding(time, x.dtype))[..., None].chunk(2, dim=1)
        r = F.silu(self.norm(self.block(h)) * (scale + 1) + shift)
        return self.final_conv(h + r)


def extract(a: torch.Tensor, t: torch.Tensor, shape) -> torch.Tensor:
    """The script's ``extract``: ``a[t]`` of each example, shaped to broadcast over ``shape``."""
    return a.gather(-1, t).reshape(t.shape[0], *((1,) * (len(shape) - 1)))


class GaussianDiffusion1D(nn.Module):
    """The script's ``GaussianDiffusion1D`` with ``objective="pred_v"``: ``forward(img)`` draws
    each example's timestep and its noise, ``p_losses`` noises the input, and half the time
    (the script's ``random() < 0.5``, here of the module's own ``random.Random``) predicts
    ``x_start`` under ``no_grad`` by the same Unet to condition on it, the output then
    ``detach_()``-ed; the loss is each example's mean squared error on ``v``, weighted by its
    timestep's ``snr / (snr + 1)``, then the batch's mean."""

    def __init__(self, model: nn.Module, timesteps: int = 10, seed: int = 0) -> None:
        import random

        super().__init__()
        self.model, self.num_timesteps = model, timesteps
        self.coin = random.Random(seed)
        betas = torch.linspace(1e-2, 0.3, timesteps)
        alphas_cumprod = torch.cumprod(1.0 - betas, 0)
        snr = alphas_cumprod / (1 - alphas_cumprod)
        self.register_buffer("sqrt_alphas_cumprod", alphas_cumprod.sqrt())
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1 - alphas_cumprod).sqrt())
        self.register_buffer("loss_weight", snr / (snr + 1))

    def predict_start_from_v(self, x_t, t, v):
        return (
            extract(self.sqrt_alphas_cumprod, t, x_t.shape) * x_t
            - extract(self.sqrt_one_minus_alphas_cumprod, t, x_t.shape) * v
        )

    def p_losses(self, x_start, t, noise=None):
        noise = torch.randn_like(x_start) if noise is None else noise
        x = (
            extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
            + extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise
        )
        x_self_cond = None
        if self.model.self_condition and self.coin.random() < 0.5:
            with torch.no_grad():
                x_self_cond = self.predict_start_from_v(x, t, self.model(x, t))
                x_self_cond.detach_()
        model_out = self.model(x, t, x_self_cond)
        target = (
            extract(self.sqrt_alphas_cumprod, t, x_start.shape) * noise
            - extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * x_start
        )
        loss = F.mse_loss(model_out, target, reduction="none").flatten(1).mean(1)
        return (loss * extract(self.loss_weight, t, loss.shape)).mean()

    def forward(self, img):
        t = torch.randint(0, self.num_timesteps, (img.shape[0],), device=img.device).long()
        return self.p_losses(img * 2 - 1, t)


class Replayed(nn.Module):
    """The diffusion's loss of given timesteps and noise, the self-conditioning coin fixed to
    ``conditioned``: what the loop runs example by example."""

    def __init__(self, diffusion: GaussianDiffusion1D, conditioned: bool) -> None:
        super().__init__()
        self.diffusion, self.conditioned = diffusion, conditioned

    def forward(self, img, t, noise):
        coin = self.diffusion.coin
        self.diffusion.coin = type(
            "Coin", (), {"random": lambda _: 0.0 if self.conditioned else 1.0}
        )()
        try:
            return self.diffusion.p_losses(img * 2 - 1, t, noise)
        finally:
            self.diffusion.coin = coin


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_denoising_diffusion_trainer_self_conditioning_under_no_grad_inside_the_loss(
    mixed_precision,
):
    """lucidrains/denoising-diffusion-pytorch ``denoising_diffusion_pytorch/
    denoising_diffusion_pytorch_1d.py``: ``Trainer1D.train`` on ``GaussianDiffusion1D(Unet1D(...,
    self_condition=True), objective="pred_v")``, the loss computed inside the hooked
    diffusion module: ``gradient_accumulate_every=2`` micro-batches each ``with
    accelerator.autocast(): loss = self.model(data) / 2``, ``total_loss += loss.item()``,
    ``accelerator.backward(loss)``; then ``accelerator.clip_grad_norm_(..., 1.0)``, Adam's
    step and ``zero_grad``, an EMA of the weights. Each example's timestep and noise are drawn
    in the forward, and on half the micro-batches the Unet runs first under ``no_grad`` on the
    same noised batch, its prediction fed back as an input. At every micro-batch grad1 (summed
    over the step's micro-batches) and the norms are the float64 loop's of each example's
    weighted loss over 2, given the same timesteps, noise and coin (``mixed_precision="no"``,
    float32: to float32's rounding; ``"bf16"``, the forward under bfloat16 autocast: within
    bfloat16's rounding); the loss is the loop's mean."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    diffusion = GaussianDiffusion1D(TimeUnet1D())
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    opt = torch.optim.Adam(diffusion.parameters(), lr=1e-2, betas=(0.9, 0.99))
    model, opt = accelerator.prepare(diffusion, opt)
    ema = AveragedModel(diffusion, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    tol = BF16 if mixed_precision == "bf16" else 1e-4
    g, accum, coins = torch.Generator().manual_seed(0), 2, set()
    try:
        with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
            for step in range(STEPS):
                want, total_loss = {}, 0.0
                for micro in range(accum):
                    data = torch.rand(6, 2, 8, generator=g)
                    seed = 100 * step + micro
                    torch.manual_seed(seed)
                    t = torch.randint(0, diffusion.num_timesteps, (6,))
                    noise = torch.randn(data.shape)
                    state = diffusion.coin.getstate()
                    conditioned = diffusion.coin.random() < 0.5
                    diffusion.coin.setstate(state)
                    coins.add(conditioned)
                    replay = Replayed(copy.deepcopy(diffusion).to(D), conditioned)
                    inputs = (data.to(D), t, noise.to(D))
                    mine = loop_grad(replay, lambda loss: loss / accum, inputs)
                    mine = {n.removeprefix("diffusion."): w for n, w in mine.items()}
                    want = {n: want.get(n, 0) + mine[n] for n in mine}
                    with torch.no_grad():
                        own = torch.stack(
                            [replay(*(v[i : i + 1] for v in inputs)) for i in range(6)]
                        )
                    torch.manual_seed(seed)
                    with accelerator.autocast():
                        loss = model(data) / accum
                    total_loss += loss.item()
                    assert loss.item() == pytest.approx(own.mean().item() / accum, rel=tol)
                    accelerator.backward(loss)
                    for n, p in diffusion.named_parameters():
                        err = relative_error(p.grad1, want[n])
                        assert err < tol, f"step {step}.{micro}: {n} off by {err:.2e}"
                    err = relative_error(h.norms(), norms_of(mine))
                    assert err < tol, f"step {step}.{micro}: norms off by {err:.2e}"
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                ema.update_parameters(diffusion)
    finally:
        AcceleratorState._reset_state(True)
    assert coins == {False, True}  # (both branches taken)
    assert not any(hasattr(p, "grad1") for p in ema.parameters())


# -- pytorch/examples mnist_hogwild: shared-memory weights trained by forked processes -----------


def hogwild_train(rank: int, model: nn.Module, lock, errors: torch.Tensor) -> None:
    """The script's ``train(rank, args, model, ...)``: its own seed and optimizer over the
    shared model, ``zero_grad``, the forward, ``nll_loss``, the backward and the step, here
    each step under ``lock`` with grad1 compared with the float64 loop at the weights the
    step ran at; the largest difference is written to ``errors[rank]``."""
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    g = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(STEPS):
        x = torch.randn(5, 3, generator=g, dtype=D)
        y = torch.randint(2, (5,), generator=g)
        with lock:
            want = loop_grad(model, F.nll_loss, x, y)
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            for n, p in model.named_parameters():
                worst = max(worst, (p.grad1 - want[n]).abs().max().item())
            opt.step()
    errors[rank] = worst


def test_mnist_hogwild_shared_memory_weights_trained_by_forked_processes():
    """pytorch/examples ``mnist_hogwild/main.py`` and ``train.py``: the hooked model's
    ``share_memory()`` (its parameters moved into shared memory after ``add_hooks``), two
    processes started by ``torch.multiprocessing`` (``fork``: the hooks come with the model)
    each training it with its own SGD, the updates landing in the one shared copy. Each
    step, taken one at a time under a lock so that the loop sees the weights the step ran at,
    gives the float64 loop's grad1 in each process; the parent's own step afterwards, at the
    weights both moved, gives the loop's grad1 too."""
    import torch.multiprocessing as mp

    if torch.get_default_device().type != "cpu":
        pytest.skip("forked processes: the default device's runtime cannot be used in them")
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2), nn.LogSoftmax(-1))
    model = model.to(D)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx = mp.get_context("fork")
    errors = torch.full((2,), -1.0, dtype=D).share_memory_()
    with gradhooks.add_hooks(model):
        model.share_memory()
        assert all(p.is_shared() for p in model.parameters())
        lock = ctx.Lock()
        procs = [ctx.Process(target=hogwild_train, args=(r, model, lock, errors)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
        assert [proc.exitcode for proc in procs] == [0, 0]
        assert 0 <= errors.max().item() < 1e-12, errors
        assert not any(torch.equal(p, start[n]) for n, p in model.named_parameters())
        x, y = torch.randn(5, 3, dtype=D), torch.randint(2, (5,))
        want = loop_grad(model, F.nll_loss, x, y)
        F.nll_loss(model(x), y).backward()
        assert_grad1(model, want, "the parent's step")


# -- karpathy/build-nanogpt train_gpt2.py: the GPT-2 reproduction loop in bfloat16 ---------------


class SmallGPT2(nn.Module):
    """build-nanogpt ``train_gpt2.py``'s ``GPT``, shrunk: token and position embeddings, two
    pre-norm blocks (causal ``scaled_dot_product_attention``, a tanh-GELU MLP), the token
    embedding tied to the head the other way round from nanoGPT
    (``transformer.wte.weight = lm_head.weight``: the head's parameter, named after the
    embedding, which ``named_parameters`` meets first); ``forward(idx,
    targets)`` returns the logits and the mean token loss."""

    def __init__(self, vocab: int = 13, dim: int = 8, heads: int = 2, length: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(length, dim),
                h=nn.ModuleList(
                    nn.ModuleDict(
                        dict(
                            ln_1=nn.LayerNorm(dim), c_attn=nn.Linear(dim, 3 * dim),
                            c_proj=nn.Linear(dim, dim), ln_2=nn.LayerNorm(dim),
                            c_fc=nn.Linear(dim, 4 * dim), mlp_proj=nn.Linear(4 * dim, dim),
                        )
                    )
                    for _ in range(2)
                ),
                ln_f=nn.LayerNorm(dim),
            )
        )  # fmt: skip
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def block(self, b: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = b.c_attn(b.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + b.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x)), approximate="tanh"))

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for b in self.transformer.h:
            x = self.block(b, x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16-autocast"])
def test_build_nanogpt_loop_reverse_tied_head_fused_adamw_and_the_clip_norm(bf16):
    """karpathy/build-nanogpt ``train_gpt2.py``: ``optimizer.zero_grad()``, ``loss_accum =
    0.0``, per micro-step ``model.require_backward_grad_sync = (micro_step == grad_accum_steps
    - 1)`` (set on the model itself, as the script does under DDP), ``with
    torch.autocast(device_type, dtype=torch.bfloat16): logits, loss = model(x, y)``, ``loss =
    loss / grad_accum_steps``, ``loss_accum += loss.detach()``, ``loss.backward()``; then
    ``norm = clip_grad_norm_(model.parameters(), 1.0)``, the cosine schedule with warm-up set
    into every ``param_group`` by hand, and ``configure_optimizers``' fused AdamW (decay on the
    parameters of two or more dimensions, betas 0.9 and 0.95). At every micro-step grad1
    (summed over the step's micro-steps, as ``.grad``) and the norms (each backward's own)
    are the float64 loop's of each example's mean token loss over 2, the tied weight holding
    both its uses; the clip's returned norm is that of the loop's mean gradient; in float64
    exactly, under bfloat16 autocast (the model float32) within bfloat16's rounding."""
    dtype = torch.float32 if bf16 else D
    model = SmallGPT2().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )  # fmt: skip

    def get_lr(it: int, warmup: int = 1, max_steps: int = STEPS, max_lr: float = 0.03) -> float:
        if it < warmup:
            return max_lr * (it + 1) / warmup
        ratio = (it - warmup) / (max_steps - warmup)
        return 0.1 * max_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9 * max_lr

    tol = BF16 if bf16 else 1e-9
    grad_accum_steps, g = 2, torch.Generator().manual_seed(0)

    def mean_token_loss(out, y):
        return F.cross_entropy(out[0].flatten(0, 1), y.flatten()) / grad_accum_steps

    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss_accum, want = 0.0, {}
            for micro_step in range(grad_accum_steps):
                x, y = (
                    torch.randint(13, (4, 6), generator=g),
                    torch.randint(13, (4, 6), generator=g),
                )
                mine = loop_grad(copy.deepcopy(model).to(D), mean_token_loss, x, y)
                want = {n: want.get(n, 0) + mine[n] for n in mine}
                model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits, loss = model(x, y)
                loss = loss / grad_accum_steps
                loss_accum += loss.detach()
                loss.backward()
                assert "lm_head.weight" not in want  # (one parameter, under its first name)
                for n, p in model.named_parameters():
                    err = relative_error(p.grad1, want[n])
                    assert err < tol, f"step {step}.{micro_step}: {n} off by {err:.2e}"
                err = relative_error(h.norms(), norms_of(mine))
                assert err < tol, f"step {step}.{micro_step}: norms off by {err:.2e}"
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            total = torch.cat([w.mean(0).flatten() for w in want.values()]).norm()
            assert relative_error(norm, total) < tol, f"step {step}: the clip's norm"
            lr = get_lr(step)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            optimizer.step()


# -- huggingface/diffusers examples/textual_inversion: one new token through a frozen UNet -------


class TinyTextEncoder(nn.Module):
    """``CLIPTextModel`` shrunk: token and position embeddings, one residual MLP layer, the
    final layer norm; ``forward(input_ids)`` returns ``(last_hidden_state,)``."""

    def __init__(self, vocab: int = 12, dim: int = 8, length: int = 6) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(length, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token_embedding

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])[None]
        h = self.token_embedding(input_ids) + self.position_embedding(positions)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return (self.final_layer_norm(h),)


class TinyCrossAttentionUNet(nn.Module):
    """A UNet's one cross-attention block: ``conv_in``, the timestep's sinusoidal embedding
    through a Linear added to every pixel, queries from the pixels and keys and values from
    the text's hidden states, ``conv_out``."""

    def __init__(self, channels: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.conv_in, self.conv_out = (
            nn.Conv2d(channels, dim, 3, padding=1),
            nn.Conv2d(dim, channels, 1),
        )
        self.time_proj = nn.Linear(dim, dim)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, sample, timesteps, encoder_hidden_states):
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        angles = timesteps[:, None].float() * freqs[None]
        temb = self.time_proj(torch.cat((angles.sin(), angles.cos()), -1).to(sample.dtype))
        h = self.conv_in(sample) + temb[..., None, None]
        B, C, H, W = h.shape
        pixels = h.flatten(2).transpose(1, 2)
        q, k, v = (
            self.to_q(pixels),
            self.to_k(encoder_hidden_states),
            self.to_v(encoder_hidden_states),
        )
        attended = self.to_out(F.scaled_dot_product_attention(q, k, v))
        return self.conv_out(h + attended.transpose(1, 2).reshape(B, C, H, W))


class TextToNoise(nn.Module):
    """The text encoder's hidden states, cast to the UNet's dtype, into the UNet: the model
    the loop runs example by example."""

    def __init__(self, text_encoder: nn.Module, unet: nn.Module) -> None:
        super().__init__()
        self.text_encoder, self.unet = text_encoder, unet

    def forward(self, input_ids, noisy_latents, timesteps):
        states = self.text_encoder(input_ids)[0].to(dtype=noisy_latents.dtype)
        return self.unet(noisy_latents, timesteps, states)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_textual_inversion_one_token_trained_through_a_frozen_unet_rows_restored(mixed_precision):
    """huggingface/diffusers ``examples/textual_inversion/textual_inversion.py``: a placeholder
    token added to the tokenizer, its embedding row initialized from an initializer token's,
    the text encoder frozen but for its input embeddings (``text_model.encoder``,
    ``final_layer_norm`` and ``position_embedding`` ``requires_grad_(False)``), the frozen
    VAE and UNet cast to ``weight_dtype`` (bfloat16 under ``mixed_precision="bf16"``, whose
    ``accelerator.prepare`` runs the text encoder under autocast), AdamW over
    ``get_input_embeddings().parameters()``; per step the latents from the VAE times its
    scaling factor, noise and a timestep per example, ``noise_scheduler.add_noise``,
    ``encoder_hidden_states = text_encoder(input_ids)[0].to(dtype=weight_dtype)``, the UNet's
    prediction, ``F.mse_loss(model_pred.float(), target.float(), reduction="mean")``,
    ``accelerator.backward``, the step, the schedule, ``zero_grad``, and every row but the
    placeholder's written back from ``orig_embeds_params`` under ``no_grad``. At every step
    grad1 of the embedding is the float64 loop's (with ``"no"``, everything in float64, within
    float32's rounding, which the loss's ``.float()`` casts bring; within bfloat16's with
    ``"bf16"``), nonzero only in rows of the
    prompt's tokens, and after the step only the placeholder's row has moved."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    weight_dtype = torch.bfloat16 if mixed_precision == "bf16" else D
    text_encoder = TinyTextEncoder().to(torch.float32 if mixed_precision == "bf16" else D)
    placeholder, initializer = 11, 3  # (the token added last, and the word it starts from)
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight[placeholder] = (
            text_encoder.get_input_embeddings().weight[initializer]
        )
    for module in (text_encoder.fc1, text_encoder.fc2, text_encoder.final_layer_norm):
        module.requires_grad_(False)
    text_encoder.position_embedding.requires_grad_(False)
    vae = nn.Conv2d(3, 2, 2, stride=2).requires_grad_(False).to(weight_dtype)
    unet = TinyCrossAttentionUNet().requires_grad_(False).to(weight_dtype)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(
        text_encoder.get_input_embeddings().parameters(), lr=0.05, betas=(0.9, 0.999),
        weight_decay=1e-2,
    )  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    text_encoder, optimizer = accelerator.prepare(text_encoder, optimizer)
    orig_embeds_params = text_encoder.get_input_embeddings().weight.data.clone()
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-3, 0.2, 50, dtype=D), 0)
    # (model_pred.float() and target.float() round the float64 prediction to float32)
    tol = BF16 if mixed_precision == "bf16" else 1e-6
    g = torch.Generator().manual_seed(0)
    try:
        with gradhooks.add_hooks(text_encoder):
            for step in range(STEPS):
                pixel_values = torch.randn(4, 3, 4, 4, generator=g, dtype=D)
                input_ids = torch.randint(1, 11, (4, 6), generator=g)
                input_ids[torch.arange(4), torch.randint(1, 5, (4,), generator=g)] = placeholder
                noise = torch.randn(4, 2, 2, 2, generator=g, dtype=D).to(weight_dtype)
                timesteps = torch.randint(0, 50, (4,), generator=g)
                latents = vae(pixel_values.to(dtype=weight_dtype)) * 0.18215
                a = alphas_cumprod[timesteps].to(weight_dtype).view(-1, 1, 1, 1)
                noisy_latents = a.sqrt() * latents + (1 - a).sqrt() * noise
                ref = TextToNoise(copy.deepcopy(text_encoder), copy.deepcopy(unet)).to(D)
                want = loop_grad(
                    ref,
                    lambda out, target: F.mse_loss(out.float(), target.float(), reduction="mean"),
                    (input_ids, noisy_latents.to(D), timesteps),
                    noise.to(D),
                )["text_encoder.token_embedding.weight"]
                encoder_hidden_states = text_encoder(input_ids)[0].to(dtype=weight_dtype)
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states)
                loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
                accelerator.backward(loss)
                grad1 = text_encoder.get_input_embeddings().weight.grad1
                err = relative_error(grad1, want)
                assert err < tol, f"step {step}: off by {err:.2e}"
                used = torch.zeros(12, dtype=torch.bool)
                used[input_ids.flatten()] = True
                assert not grad1[:, ~used].any(), f"step {step}: rows of unused tokens"
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
                index_no_updates = torch.ones((12,), dtype=torch.bool)
                index_no_updates[placeholder : placeholder + 1] = False
                with torch.no_grad():
                    text_encoder.get_input_embeddings().weight[index_no_updates] = (
                        orig_embeds_params[index_no_updates]
                    )
                moved = text_encoder.get_input_embeddings().weight != orig_embeds_params
                assert moved.any(1).nonzero().flatten().tolist() == [placeholder]
    finally:
        AcceleratorState._reset_state(True)


# -- huggingface/transformers Trainer: accumulation with num_items_in_batch ------------------------


class CausalLogits(nn.Module):
    """A causal LM's logits from its ``input_ids`` and ``attention_mask``, for the loop."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_trainer_accumulation_divides_by_the_token_count_of_the_whole_step(tmp_path, bf16):
    """huggingface/transformers ``src/transformers/trainer.py`` (``_inner_training_loop``,
    ``get_batch_samples``, ``training_step``), unsubclassed, on a tiny ``GPT2LMHeadModel``
    (its head tied to the token embedding) with ``gradient_accumulation_steps=2``: the
    Trainer loads the step's two micro-batches first and counts their labels not ignored
    (``labels[..., 1:] != -100``) into ``num_items_in_batch``, which it passes to the model,
    whose loss is then the sum of token losses over that count (and not divided again by the
    accumulation steps). With ``add_hooks(loss_reduction="sum")``, grad1 read in
    ``on_pre_optimizer_step`` (after Trainer's clipping, which leaves it alone) is, for each
    example of the step's two micro-batches, its own token losses' gradient over the step's
    count: the float64 loop's, given what the Trainer passed (read by a forward pre-hook),
    within float32's rounding in float64 (the model's loss rounds the logits to float32) and
    within bfloat16's with ``bf16=True``."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model = model.float() if bf16 else model.to(D)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        length = int(torch.randint(4, 9, (1,), generator=g))
        ids = torch.randint(1, 16, (8,), generator=g)
        mask = (torch.arange(8) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[: int(torch.randint(1, 3, (1,), generator=g))] = -100  # (a prompt, not learned)
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    seen: list = []

    def record(module, args, kwargs):
        kept = {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "labels")}
        seen[-1]["micro"].append((kept, kwargs.get("num_items_in_batch")))

    class ReadGrad1(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            seen.append({"params": params, "micro": []})

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen[-1]["grad1"] = {n: p.grad1.clone() for n, p in model.named_parameters()}

    recording = model.register_forward_pre_hook(record, with_kwargs=True)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=3, gradient_accumulation_steps=2,
        max_steps=2, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.1, use_cpu=True, bf16=bf16, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0,
    )  # fmt: skip
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows, callbacks=[ReadGrad1()]
        )
        trainer.train()
    recording.remove()
    assert len(seen) == 2 and all(len(s["micro"]) == 2 for s in seen)
    ref = CausalLogits(copy.deepcopy(model).to(D))
    # (transformers' causal LM loss calls logits.float(), which rounds a float64 model's
    # logits to float32: float32's rounding, then, even in float64)
    tol = BF16 if bf16 else 1e-5
    for k, step in enumerate(seen):
        with torch.no_grad():
            for n, p in ref.model.named_parameters():
                p.copy_(step["params"][n])
        counts = {float(count) for _, count in step["micro"]}
        want_count = sum(int((i["labels"][..., 1:] != -100).sum()) for i, _ in step["micro"])
        assert counts == {want_count}, (counts, want_count)
        want: dict = {}
        for inputs, _ in step["micro"]:

            def own(logits, labels, count=want_count):
                return F.cross_entropy(
                    logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                    reduction="sum",
                ) / count  # fmt: skip

            x = (inputs["input_ids"], inputs["attention_mask"])
            mine = loop_grad(ref, own, x, inputs["labels"])
            want = {n: want.get(n, 0) + mine[n] for n in mine}
        want = {n.removeprefix("model."): w for n, w in want.items()}
        assert set(want) == set(step["grad1"])
        for n, w in want.items():
            err = relative_error(step["grad1"][n], w)
            assert err < tol, f"step {k}: {n} off by {err:.2e}"


# -- huggingface/accelerate examples/by_feature/memory.py: a batch size found by retrying ---------

CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1073741824 bytes."
)  # (the CPU allocator's message, which accelerate's should_reduce_batch_size looks for)


class AllocatesPerExample(nn.Module):
    """The identity, whose forward fails as the CPU allocator does for a batch of more than
    ``fits`` examples: the memory a real layer would run out of."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits

    def forward(self, x):
        if x.shape[0] > self.fits:
            raise RuntimeError(CPU_OOM)
        return x


class AllocatesInBackward(torch.autograd.Function):
    """The identity, whose backward fails as the CPU allocator does for a batch of more than
    4 examples (after the head's gradient is formed, before the first layer's)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if g.shape[0] > 4:
            raise RuntimeError(CPU_OOM)
        return g


class FailsBackward(nn.Module):
    def forward(self, x):
        return AllocatesInBackward.apply(x)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_find_executable_batch_size_retries_a_step_that_ran_out_of_memory(where):
    """huggingface/accelerate ``examples/by_feature/memory.py``: the training loop inside a
    function decorated by ``accelerate.utils.find_executable_batch_size(starting_batch_size=8)``,
    which calls it again with a batch 0.9 times smaller whenever it raises an out-of-memory
    ``RuntimeError`` (here the CPU allocator's, raised in the hooked model's forward or in its
    backward past the head, for batches of more than 4), the hooked model kept across the
    attempts (the example builds it anew in each). The attempts at 8, 7, 6 and 5 fail part-way
    through their first forward or backward and leave nothing behind: at 4, each step's grad1
    and norms are the float64 loop's, and the weights are those of the same steps taken
    without the failed attempts."""
    from accelerate.utils import find_executable_batch_size

    torch.manual_seed(0)
    middle = AllocatesPerExample(4) if where == "forward" else FailsBackward()
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), middle, nn.Linear(6, 2)).to(D)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    x_all, y_all = labelled_batch(0, n=16)
    tried = []
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:

        @find_executable_batch_size(starting_batch_size=8)
        def inner_training_loop(batch_size):
            tried.append(batch_size)
            for i in range(0, len(x_all), batch_size):
                x, y = x_all[i : i + batch_size], y_all[i : i + batch_size]
                want = loop_grad(twin, F.cross_entropy, x, y)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                assert_grad1(model, want, f"batch of {batch_size} at {i}")
                assert_close(h.norms(), norms_of(want), f"batch of {batch_size} at {i}: norms")
                opt.step()
                twin_opt.zero_grad()
                F.cross_entropy(twin(x), y).backward()
                twin_opt.step()

        inner_training_loop()
    assert tried == [8, 7, 6, 5, 4]
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


# -- karpathy/nanochat scripts/base_train.py: rotary, QK norm, softcap, Muon ----------------------


def rms(x):
    """nanochat's ``norm``: a functional RMSNorm without parameters."""
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3).to(x.dtype)


class ChatBlock(nn.Module):
    """nanochat ``nanochat/gpt.py``'s ``Block``: multi-query attention (two query heads, one
    key and value head repeated) with rotary embeddings and QK norm, a ReLU² MLP, no biases,
    each half behind a parameter-free RMSNorm."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, self.head_dim, bias=False)
        self.c_v = nn.Linear(dim, self.head_dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.c_fc, self.mlp_proj = (
            nn.Linear(dim, 4 * dim, bias=False),
            nn.Linear(4 * dim, dim, bias=False),
        )

    def attention(self, x, cos, sin):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.heads, self.head_dim)
        k = self.c_k(x).view(B, T, 1, self.head_dim)
        v = self.c_v(x).view(B, T, 1, self.head_dim)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = rms(q), rms(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k[:, :, None].expand(B, 1, self.heads, T, self.head_dim).reshape(B, self.heads, T, -1)
        v = v[:, :, None].expand(B, 1, self.heads, T, self.head_dim).reshape(B, self.heads, T, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))

    def forward(self, x, cos, sin):
        x = x + self.attention(rms(x), cos, sin)
        return x + self.mlp_proj(F.relu(self.c_fc(rms(x))).square())


class ChatGPT(nn.Module):
    """nanochat's ``GPT``, shrunk: an untied token embedding (cast to bfloat16 where the model
    trains in it, as the script does), two blocks, rotary tables kept in bfloat16 as buffers,
    the head's logits soft-capped at 15; ``forward(idx, targets)`` returns the token loss
    (``ignore_index=-1``), the logits without targets."""

    def __init__(self, vocab: int = 13, dim: int = 8, heads: int = 2, length: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, dim),
                "h": nn.ModuleList(ChatBlock(dim, heads) for _ in range(2)),
            }
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        inv_freq = 1.0 / (
            10000 ** (torch.arange(0, dim // heads, 2, dtype=torch.float32) / (dim // heads))
        )
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().bfloat16()[None, :, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin().bfloat16()[None, :, None, :], persistent=False)

    def forward(self, idx, targets=None, loss_reduction="mean"):
        T = idx.shape[1]
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x = rms(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos, sin)
        logits = self.lm_head(rms(x))
        logits = (15 * torch.tanh(logits / 15)).float()
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
            reduction=loss_reduction,
        )  # fmt: skip


def chat_gpt(bf16: bool) -> ChatGPT:
    """nanochat's model as its scripts run it: the embedding in bfloat16 (``bf16``), or the
    whole model in float64."""
    model = ChatGPT()
    if bf16:
        model.transformer.wte.to(dtype=torch.bfloat16)
        return model
    return model.to(D)


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """nanochat ``nanochat/muon.py``: the Newton-Schulz iteration that orthogonalizes ``G``,
    in bfloat16."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


class Muon(torch.optim.Optimizer):
    """nanochat's ``Muon``: momentum, Nesterov's look-ahead written into ``p.grad`` in place
    (``g.lerp_(buf, momentum)``), the orthogonalized update scaled by the matrix's aspect."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(g))
                buf.lerp_(g, 1 - group["momentum"])
                g = g.lerp_(buf, group["momentum"])
                update = zeropower_via_newtonschulz5(g).to(p.dtype)
                p.add_(update, alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_nanochat_base_train_muon_and_adamw_with_the_grads_changed_in_place(bf16):
    """karpathy/nanochat ``scripts/base_train.py`` over ``nanochat/gpt.py`` and
    ``nanochat/muon.py``: ``setup_optimizers`` (fused AdamW, betas 0.8 and 0.95, for the head
    and the embedding, the embedding cast to bfloat16 when training in it; Muon for every
    block matrix), two micro-steps per step, each ``with autocast_ctx: loss = model(x, y)``,
    ``loss = loss / grad_accum_steps``, ``loss.backward()`` and the next batch fetched; then
    ``clip_grad_norm_(1.0)``, every group's ``lr`` set to ``initial_lr * lrm`` and Muon's
    ``momentum`` warmed up by hand, both optimizers stepped (Muon writes its Nesterov
    look-ahead into ``p.grad`` in place) and ``model.zero_grad(set_to_none=True)``. At every
    micro-step grad1 (summed over the step's micro-steps) and the norms are the float64
    loop's of each example's mean token loss over 2 (every target valid, as in pretraining):
    in float64 within float32's rounding (the model's ``logits.float()`` rounds them; the
    rotary tables are bfloat16 values, the same in the loop), within bfloat16's under
    ``bf16`` (``grad1`` of the embedding in bfloat16, its own dtype); the optimizers' writes
    to ``.grad`` leave it alone."""
    model = chat_gpt(bf16)
    adamw = torch.optim.AdamW(
        [{"params": list(model.lm_head.parameters()), "lr": 0.004},
         {"params": list(model.transformer.wte.parameters()), "lr": 0.2}],
        betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=True,
    )  # fmt: skip
    muon = Muon(list(model.transformer.h.parameters()), lr=0.02, momentum=0.95)
    optimizers = [adamw, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    # (the model's logits.float() rounds a float64 model's logits to float32: float32's
    # rounding, then, in float64)
    grad_accum_steps, g, tol = 2, torch.Generator().manual_seed(0), BF16 if bf16 else 1e-5

    def next_batch():
        return torch.randint(13, (4, 6), generator=g), torch.randint(13, (4, 6), generator=g)

    def own(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1) / 2

    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        x, y = next_batch()
        for step in range(STEPS):
            want: dict = {}
            for micro_step in range(grad_accum_steps):
                mine = loop_grad(copy.deepcopy(model).to(D), own, x, y)
                want = {n: want.get(n, 0) + mine[n] for n in mine}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(x, y)
                loss = loss / grad_accum_steps
                loss.backward()
                x, y = next_batch()
                for n, p in model.named_parameters():
                    assert p.grad1.dtype == p.dtype, n
                    err = relative_error(p.grad1, want[n])
                    assert err < tol, f"step {step}.{micro_step}: {n} off by {err:.2e}"
                err = relative_error(h.norms(), norms_of(mine))
                assert err < tol, f"step {step}.{micro_step}: norms off by {err:.2e}"
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lrm = 1.0 - step / (2 * STEPS)
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * lrm
            for group in muon.param_groups:
                group["momentum"] = (1 - min(step / 300, 1)) * 0.85 + min(step / 300, 1) * 0.95
            for opt in optimizers:
                opt.step()
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), f"step {step}: the optimizers changed {n}"
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_nanochat_chat_rl_token_level_policy_gradient_over_passes(bf16):
    """karpathy/nanochat ``scripts/chat_rl.py``: per step, for each of ``examples_per_rank=2``
    prompts, 8 sampled completions (targets -1 over the prompt and after each completion's
    end), rewards of 0 or 1 and ``advantages = rewards - rewards.mean()`` over the prompt's
    samples; the samples in ``num_passes=2`` passes of ``device_batch_size=4``, each
    ``logp = -model(inputs, targets, loss_reduction='none').view_as(inputs)`` under autocast,
    ``pg_obj = (logp * advantages.unsqueeze(-1)).sum()`` over ``num_valid * num_passes *
    examples_per_rank`` (DAPO's token-level normalization), ``(-pg_obj).backward()``; then the
    optimizers' step and ``model.zero_grad(set_to_none=True)``. With ``loss_reduction="sum"``
    grad1 after each pass (the sum over the step's passes so far) and each pass's norms are
    the float64 loop's of each sample's own term: in float64 within float32's rounding (the
    model's logits are cast to float32), within bfloat16's under ``bf16``."""
    model = chat_gpt(bf16)
    adamw = torch.optim.AdamW(
        list(model.lm_head.parameters()) + list(model.transformer.wte.parameters()), lr=0.004,
        betas=(0.8, 0.95), eps=1e-10, fused=True,
    )  # fmt: skip
    muon = Muon(list(model.transformer.h.parameters()), lr=0.02)
    examples_per_rank, num_samples, device_batch_size = 2, 8, 4
    num_passes = num_samples // device_batch_size
    g, tol = torch.Generator().manual_seed(0), BF16 if bf16 else 1e-5  # (float32 logits)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms"), loss_reduction="sum") as h:
        for step in range(2):
            want: dict = {}
            for _ in range(examples_per_rank):
                inputs_all = torch.randint(13, (num_samples, 6), generator=g)
                targets_all = torch.randint(13, (num_samples, 6), generator=g)
                ends = torch.randint(3, 7, (num_samples,), generator=g)
                where = torch.arange(6)
                targets_all[(where < 2) | (where >= ends[:, None])] = -1
                rewards_all = torch.randint(2, (num_samples,), generator=g).to(D)
                advantages_all = rewards_all - rewards_all.mean()
                for pass_idx in range(num_passes):
                    b0, b1 = pass_idx * device_batch_size, (pass_idx + 1) * device_batch_size
                    inputs, targets = inputs_all[b0:b1], targets_all[b0:b1]
                    advantages = advantages_all[b0:b1]
                    num_valid = (targets >= 0).sum().clamp(min=1)
                    scale = num_valid * num_passes * examples_per_rank

                    def own(logits, target, scale=scale):
                        y, a = target[..., :-1].long(), target[..., -1]
                        nll = F.cross_entropy(
                            logits.transpose(1, 2), y, ignore_index=-1, reduction="none"
                        )
                        return (nll * a[:, None]).sum() / scale

                    target = torch.cat((targets.to(D), advantages[:, None]), 1)
                    mine = loop_grad(copy.deepcopy(model).to(D), own, inputs, target)
                    want = {n: want.get(n, 0) + mine[n] for n in mine}
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        logp = -model(inputs, targets, loss_reduction="none").view_as(inputs)
                    pg_obj = (logp * advantages.unsqueeze(-1)).sum()
                    pg_obj = pg_obj / scale
                    (-pg_obj).backward()
                    for n, p in model.named_parameters():
                        err = relative_error(p.grad1, want[n])
                        assert err < tol, f"step {step}, pass {pass_idx}: {n} off by {err:.2e}"
                    err = relative_error(h.norms(), norms_of(mine))
                    assert err < tol, f"step {step}, pass {pass_idx}: norms off by {err:.2e}"
            adamw.step()
            muon.step()
            model.zero_grad(set_to_none=True)

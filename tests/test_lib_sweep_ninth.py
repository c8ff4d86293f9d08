"""A ninth round of other projects' models against the per-example loop, and twelve of them
trained as their users train them.

Each model is a small excerpt of a public project's model code, rewritten in plain torch (each
class cites the repository and file it follows), at a tiny configuration: LLM blocks as
educational and reference repositories write them (LLMs-from-scratch's Qwen3 with grouped-query
attention, query and key norms and a dense mixture of experts gated by ``scatter_``, its Gemma 3
with sliding-window and global layers, and its GPT-2 trained through the KV cache, a prompt and
then the next tokens; Mistral's reference Mixtral, complex rotary, a sliding-window mask, keys
written into a rotating cache and experts routed by ``torch.where`` and ``results[idx] +=``;
DeepSeek-V3's multi-head latent attention reading its keys back from its caches, and its
group-limited router and experts counted by ``bincount(...).tolist()``), vision blocks (Swin's
shifted windows by ``torch.roll`` and view/permute, Swin V2's cosine attention with a bias made by
an MLP of a coordinate table and the projection's weight used outside its layer, PoolFormer,
EfficientNet's squeeze-and-excitation with a hand-written swish and "same" padding computed per
input, ConvMixer, CoAtNet's relative attention, PointNet++'s farthest points and ball queries
gathered by ``points[arange(B)..., idx]``), time series (N-HiTS, Informer's ProbSparse
attention writing each example's top queries into the context in place, DeepAR stepping an LSTM
sequence first and writing its predictions into the missing inputs), recommendation (BERT4Rec,
AutoInt's heads stacked in front of the batch, DIN's attention over each history's length, DPR's
in-batch negatives, LightGCN's tables propagated over the interaction graph), graphs in plain
torch (PyG's ``SAGEConv`` and ``GATConv`` over a batch of signals on one fixed graph, by
``index_add_`` and ``scatter_reduce_``), and reinforcement learning (CleanRL's PPO with
``Categorical`` and ``Normal`` policies and its clipped losses, SAC's tanh-squashed Gaussian with
and without its entropy temperature learned).

Each is built in float64 and training mode; ``grad1`` and the per-example norms of one backward
are compared with a loop of batches of one (``rtol=1e-7``; ``1e-6`` or ``1e-5`` where the model
computes in float32 inside, as its authors wrote it): 26 match, DPR's with the passages of the
batch taken as shared by every question (a second input as long as the batch, through which the
examples would meet), each question's loss against them all. DPR's passage encoder, of two
layers, was once refused so: only the second layer's output was followed to where it met the
questions (``tests/test_sizes.py``). Three, whose examples meet, are refused by gradhooks' own
error naming the layer, leaving the model, ``.grad``, ``grad1`` and the hooks as they were:
ConvMixer's and DIN's Dice batch norms in training mode, and AutoInt as DeepCTR-Torch writes it
(its softmax over dimension 1 is over the batch). Mixtral's experts, put back by
``results[batch_idx] += ...`` into ``zeros_like(h)``, were once refused: the zeros picked by the
routing index were taken to have an unknown layout (``tests/test_moe.py``). DeepSeek-V3's caches
of more rows than the batch are refused where the loop works (a strict xfail, with the reason).
Twelve are then trained in float32 as their users train them: three steps of ``zero_grad``, a
forward under CPU bfloat16 autocast, ``backward`` (or gradhooks' DP step) and an AdamW step,
each step's ``grad1`` (or clipped ``.grad``) against the float64 loop within bfloat16's
tolerance plus twice the error of the same model's own loop under the same autocast
(``test_lib_sweep_eighth.train_bf16``).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from test_lib_sweep_eighth import Spec, assert_matches_loop, built, train_bf16
from test_lib_sweep_seventh import cross_entropy, mse
from torch import nn
from torch.distributions import Categorical, Normal

import gradhooks
from harness import corrupting, one_thread, raised  # noqa: F401 (one_thread: an autouse fixture)

B = 3  # the batch


def assert_refused(factory, error: type, says: list[str]) -> None:
    """Refused by gradhooks' own ``error``, whose message names ``says``; the model left as it
    was: its parameters, no ``.grad`` or ``grad1`` written, no hook of gradhooks' left."""
    spec = built(factory)
    before = {n: p.detach().clone() for n, p in spec.model.named_parameters()}
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in spec.model.modules()]

    def run():
        with gradhooks.add_hooks(spec.model, loss_reduction="sum", **spec.hooks):
            spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()

    raised(error, says, run)
    for n, p in spec.model.named_parameters():
        assert p.grad is None and getattr(p, "grad1", None) is None, n
        assert torch.equal(p.detach(), before[n]), n
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in spec.model.modules()] == (
        hooks
    )


def tokens(vocab=13, length=7):
    ids = torch.randint(vocab, (B, length))
    return ids[:, :-1], ids[:, 1:]


# -- LLM blocks written in plain torch ----------------------------------------------------------


class ScratchRMSNorm(nn.Module):
    """rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/qwen3.py``: ``RMSNorm`` (computed in
    float32, ``qwen3_compatible``); ``gemma=True`` is ``ch05/12_gemma3/standalone-gemma3.ipynb``'s,
    a zero-centred scale used as ``1 + scale``."""

    def __init__(self, dim, eps=1e-6, gemma=False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.scale = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        norm_x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        scale = 1.0 + self.scale.float() if self.gemma else self.scale
        return (norm_x * scale).to(dtype)


def compute_rope_params(head_dim, theta_base=10_000.0, context_length=16):
    """rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/qwen3.py``: ``compute_rope_params``."""
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(context_length).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    """rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/qwen3.py``: ``apply_rope`` (halves)."""
    seq_len, head_dim = x.shape[2], x.shape[3]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos, sin = cos[:seq_len].unsqueeze(0).unsqueeze(0), sin[:seq_len].unsqueeze(0).unsqueeze(0)
    return ((x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).to(dtype=x.dtype)


class GroupedQueryAttention(nn.Module):
    """rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/qwen3.py``: ``GroupedQueryAttention``
    (keys and values of fewer heads ``repeat_interleave``d, RMSNorms of queries and keys, a
    boolean mask by ``masked_fill``); ``scaling`` is Gemma 3's ``query_pre_attn_scalar``."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim, scaling=None):
        super().__init__()
        self.num_heads, self.num_kv_groups, self.head_dim = num_heads, num_kv_groups, head_dim
        self.group_size, self.d_out, self.scaling = (
            num_heads // num_kv_groups,
            num_heads * head_dim,
            scaling,
        )
        self.W_query = nn.Linear(d_in, self.d_out, bias=False)
        self.W_key = nn.Linear(d_in, num_kv_groups * head_dim, bias=False)
        self.W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=False)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False)
        self.q_norm = ScratchRMSNorm(head_dim, gemma=scaling is not None)
        self.k_norm = ScratchRMSNorm(head_dim, gemma=scaling is not None)

    def forward(self, x, mask, cos, sin):
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, n, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, n, self.num_kv_groups, self.head_dim).transpose(1, 2)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if self.scaling is not None:
            q = q * self.scaling
        k = k.repeat_interleave(self.group_size, dim=1)
        v = v.repeat_interleave(self.group_size, dim=1)
        scores = (q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf)
        weights = torch.softmax(scores / (1.0 if self.scaling else self.head_dim**0.5), dim=-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, self.d_out))


class MoEFeedForward(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch05/11_qwen3/standalone-qwen3-moe.ipynb``:
    ``MoEFeedForward``, every expert run on every token, the top-k probabilities scattered
    into a dense gate by ``scatter_`` and the experts' outputs summed by it."""

    def __init__(self, emb_dim, hidden_dim, num_experts=4, num_experts_per_tok=2):
        super().__init__()
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.gate = nn.Linear(emb_dim, num_experts, bias=False)
        self.fc1 = nn.ModuleList(
            nn.Linear(emb_dim, hidden_dim, bias=False) for _ in range(num_experts)
        )
        self.fc2 = nn.ModuleList(
            nn.Linear(emb_dim, hidden_dim, bias=False) for _ in range(num_experts)
        )
        self.fc3 = nn.ModuleList(
            nn.Linear(hidden_dim, emb_dim, bias=False) for _ in range(num_experts)
        )

    def forward(self, x):
        scores = self.gate(x)
        topk_scores, topk_indices = torch.topk(scores, self.num_experts_per_tok, dim=-1)
        topk_probs = torch.softmax(topk_scores, dim=-1)
        expert_outputs = []
        for e in range(self.num_experts):
            hidden = F.silu(self.fc1[e](x)) * self.fc2[e](x)
            expert_outputs.append(self.fc3[e](hidden).unsqueeze(-2))
        expert_outputs = torch.cat(expert_outputs, dim=-2)
        gating_probs = torch.zeros_like(scores)
        for i in range(self.num_experts_per_tok):
            gating_probs.scatter_(
                dim=-1, index=topk_indices[..., i : i + 1], src=topk_probs[..., i : i + 1]
            )
        return (gating_probs.unsqueeze(-1) * expert_outputs).sum(dim=-2)


class Qwen3MoE(nn.Module):
    """rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/qwen3.py``: ``Qwen3Model`` and
    ``TransformerBlock`` (pre-norm, a ``triu`` causal mask made per forward, the rotary tables
    as buffers), its feedforwards the MoE notebook's, the head tied to the embedding."""

    def __init__(self, vocab=13, emb_dim=8, n_layers=2, heads=4, kv_groups=2, head_dim=4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, emb_dim)
        self.norm1 = nn.ModuleList(ScratchRMSNorm(emb_dim) for _ in range(n_layers))
        self.att = nn.ModuleList(
            GroupedQueryAttention(emb_dim, heads, kv_groups, head_dim) for _ in range(n_layers)
        )
        self.norm2 = nn.ModuleList(ScratchRMSNorm(emb_dim) for _ in range(n_layers))
        self.ff = nn.ModuleList(MoEFeedForward(emb_dim, 6) for _ in range(n_layers))
        self.final_norm = ScratchRMSNorm(emb_dim)
        self.out_head = nn.Linear(emb_dim, vocab, bias=False)
        self.out_head.weight = self.tok_emb.weight
        cos, sin = compute_rope_params(head_dim, 1_000_000.0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        for norm1, att, norm2, ff in zip(self.norm1, self.att, self.norm2, self.ff):
            x = att(norm1(x), mask, self.cos, self.sin) + x
            x = ff(norm2(x)) + x
        return self.out_head(self.final_norm(x))


def qwen3_moe():
    x, y = tokens()
    return Spec(Qwen3MoE(), (x,), cross_entropy, (y,), rtol=1e-5)  # (norms in float32)


class Gemma3FeedForward(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch05/12_gemma3/standalone-gemma3.ipynb``: ``FeedForward``,
    a gate by tanh-approximated GELU."""

    def __init__(self, emb_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(emb_dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(emb_dim, hidden_dim, bias=False)
        self.fc3 = nn.Linear(hidden_dim, emb_dim, bias=False)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc1(x), approximate="tanh") * self.fc2(x))


class Gemma3Block(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch05/12_gemma3/standalone-gemma3.ipynb``:
    ``TransformerBlock``, four norms (before and after attention and feedforward), sliding or
    full attention by ``attn_type``, each with its own rotary base."""

    def __init__(self, emb_dim, attn_type):
        super().__init__()
        self.attn_type = attn_type
        self.att = GroupedQueryAttention(emb_dim, 2, 1, 4, scaling=4**-0.5)
        self.ff = Gemma3FeedForward(emb_dim, 12)
        self.input_layernorm = ScratchRMSNorm(emb_dim, gemma=True)
        self.post_attention_layernorm = ScratchRMSNorm(emb_dim, gemma=True)
        self.pre_feedforward_layernorm = ScratchRMSNorm(emb_dim, gemma=True)
        self.post_feedforward_layernorm = ScratchRMSNorm(emb_dim, gemma=True)

    def forward(self, x, mask_global, mask_local, rope_global, rope_local):
        local = self.attn_type == "sliding_attention"
        mask, (cos, sin) = (mask_local, rope_local) if local else (mask_global, rope_global)
        x = x + self.post_attention_layernorm(self.att(self.input_layernorm(x), mask, cos, sin))
        return x + self.post_feedforward_layernorm(self.ff(self.pre_feedforward_layernorm(x)))


class Gemma3(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch05/12_gemma3/standalone-gemma3.ipynb``: ``Gemma3Model``,
    the embedding scaled by ``sqrt(emb_dim)``, the sliding-window mask made from the causal one
    (``mask_global | triu(ones, sliding_window).T``), local layers before a global one, the head
    tied."""

    def __init__(self, vocab=13, emb_dim=8, sliding_window=2):
        super().__init__()
        self.emb_dim, self.sliding_window = emb_dim, sliding_window
        self.tok_emb = nn.Embedding(vocab, emb_dim)
        self.blocks = nn.ModuleList(
            Gemma3Block(emb_dim, kind)
            for kind in ("sliding_attention", "sliding_attention", "full_attention")
        )
        self.final_norm = ScratchRMSNorm(emb_dim, gemma=True)
        self.out_head = nn.Linear(emb_dim, vocab, bias=False)
        self.out_head.weight = self.tok_emb.weight
        for name, base in (("global", 1_000_000.0), ("local", 10_000.0)):
            cos, sin = compute_rope_params(4, base)
            self.register_buffer(f"cos_{name}", cos, persistent=False)
            self.register_buffer(f"sin_{name}", sin, persistent=False)

    def forward(self, input_ids):
        x = self.tok_emb(input_ids) * (self.emb_dim**0.5)
        ones = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)
        mask_global = torch.triu(ones, diagonal=1)
        mask_local = mask_global | torch.triu(ones, diagonal=self.sliding_window).T
        rope_global, rope_local = (
            (self.cos_global, self.sin_global),
            (self.cos_local, self.sin_local),
        )
        for block in self.blocks:
            x = block(x, mask_global, mask_local, rope_global, rope_local)
        return self.out_head(self.final_norm(x))


def gemma3():
    x, y = tokens()
    return Spec(Gemma3(), (x,), cross_entropy, (y,), rtol=1e-5)  # (norms in float32)


class ScratchLayerNorm(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch04/03_kv-cache/gpt_with_kv_cache.py``: ``LayerNorm``
    (``scale`` and ``shift``, the biased variance)."""

    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale, self.shift = (
            nn.Parameter(torch.ones(emb_dim)),
            nn.Parameter(torch.zeros(emb_dim)),
        )

    def forward(self, x):
        mean, var = x.mean(dim=-1, keepdim=True), x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class CachedMultiHeadAttention(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch04/03_kv-cache/gpt_with_kv_cache.py``:
    ``MultiHeadAttention`` whose keys and values are kept in buffers between calls
    (``use_cache=True``), concatenated to the next call's, the causal mask's rows read from
    ``ptr_current_pos``."""

    def __init__(self, d, heads, context_length=16):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d, heads, d // heads
        self.W_query, self.W_key, self.W_value = (nn.Linear(d, d, bias=True) for _ in range(3))
        self.out_proj = nn.Linear(d, d)
        self.register_buffer(
            "mask",
            torch.triu(torch.ones(context_length, context_length), diagonal=1),
            persistent=False,
        )
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        keys_new, values_new, queries = (
            split(self.W_key(x)),
            split(self.W_value(x)),
            split(self.W_query(x)),
        )
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=2)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=2)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        attn_scores = queries @ keys.transpose(2, 3)
        n_q, n_k = queries.shape[-2], keys.shape[-2]
        if use_cache:
            mask_bool = self.mask.bool()[self.ptr_current_pos : self.ptr_current_pos + n_q, :n_k]
            self.ptr_current_pos += n_q
        else:
            mask_bool = self.mask.bool()[:n_q, :n_k]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).contiguous().view(b, n, self.d_out)
        return self.out_proj(context)

    def reset_cache(self):
        self.cache_k, self.cache_v, self.ptr_current_pos = None, None, 0


class CachedGPT(nn.Module):
    """rasbt/LLMs-from-scratch, ``ch04/03_kv-cache/gpt_with_kv_cache.py``: ``GPTModel`` and
    ``TransformerBlock`` (the tanh GELU written out), positions counted on from ``current_pos``
    under the cache; called as its ``generate_text_simple_cached`` calls it, a prompt and then
    the next tokens through the cache, trained on both calls' logits."""

    def __init__(self, vocab=13, d=8, n_layers=2, context_length=16):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(context_length, d)
        self.norm1 = nn.ModuleList(ScratchLayerNorm(d) for _ in range(n_layers))
        self.att = nn.ModuleList(CachedMultiHeadAttention(d, 2) for _ in range(n_layers))
        self.norm2 = nn.ModuleList(ScratchLayerNorm(d) for _ in range(n_layers))
        self.ff = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.Identity(), nn.Linear(4 * d, d))
            for _ in range(n_layers)
        )
        self.final_norm = ScratchLayerNorm(d)
        self.out_head = nn.Linear(d, vocab, bias=False)
        self.current_pos = 0

    @staticmethod
    def gelu(x):
        return (
            0.5
            * x
            * (
                1
                + torch.tanh(
                    torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))
                )
            )
        )

    def step(self, in_idx, use_cache=False):
        n = in_idx.shape[1]
        start = self.current_pos if use_cache else 0
        pos_ids = torch.arange(start, start + n, dtype=torch.long)
        if use_cache:
            self.current_pos += n
        x = self.tok_emb(in_idx) + self.pos_emb(pos_ids).unsqueeze(0)
        for norm1, att, norm2, ff in zip(self.norm1, self.att, self.norm2, self.ff):
            x = att(norm1(x), use_cache=use_cache) + x
            x = ff[2](self.gelu(ff[0](norm2(x)))) + x
        return self.out_head(self.final_norm(x))

    def forward(self, in_idx, prompt=4):
        for att in self.att:
            att.reset_cache()
        self.current_pos = 0
        first = self.step(in_idx[:, :prompt], use_cache=True)
        return torch.cat([first, self.step(in_idx[:, prompt:], use_cache=True)], dim=1)


def gpt2_kv_cache():
    x, y = tokens()
    return Spec(CachedGPT(), (x,), cross_entropy, (y,))


def precompute_freqs_cis(dim, end, theta=10000.0):
    """mistralai/mistral-src, ``one_file_ref.py``: ``precompute_freqs_cis`` (complex)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """mistralai/mistral-src, ``one_file_ref.py``: ``apply_rotary_emb`` by
    ``view_as_complex`` of float32 pairs."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))  # fmt: skip


class MistralAttention(nn.Module):
    """mistralai/mistral-src, ``one_file_ref.py``: ``Attention``, the prefill's keys and values
    written into a rotating cache buffer of ``max_batch_size`` rows (``cache_k[:bsz,
    scatter_pos] = xk[:, -sliding_window:]``), its own keys used, repeated for the query heads;
    the scores softmaxed in float32."""

    def __init__(self, dim=8, n_heads=4, n_kv_heads=2, sliding_window=3, max_batch_size=4):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.repeats, self.scale, self.sliding_window = (
            n_heads // n_kv_heads,
            (dim // n_heads) ** -0.5,
            sliding_window,
        )
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        shape = (max_batch_size, sliding_window, n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, freqs_cis, positions, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        scatter_pos = positions[-self.sliding_window :] % self.sliding_window
        self.cache_k[:bsz, scatter_pos] = xk[:, -self.sliding_window :]
        self.cache_v[:bsz, scatter_pos] = xv[:, -self.sliding_window :]
        key = torch.repeat_interleave(xk, repeats=self.repeats, dim=2).transpose(1, 2)
        value = torch.repeat_interleave(xv, repeats=self.repeats, dim=2).transpose(1, 2)
        scores = torch.matmul(xq.transpose(1, 2), key.transpose(2, 3)) * self.scale
        scores = F.softmax((scores + mask[None, None, ...]).float(), dim=-1).type_as(xq)
        return self.wo(
            torch.matmul(scores, value).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        )


class MistralMoeLayer(nn.Module):
    """mistralai/mistral-src, ``moe_one_file_ref.py``: ``MoeLayer``, the tokens squashed into
    rows, each expert run on the rows that chose it (``torch.where``), its output added back by
    ``results[batch_idx] += ...``; the gate's top-2 softmaxed in float32."""

    def __init__(self, dim=8, hidden=12, num_experts=4, num_experts_per_tok=2):
        super().__init__()
        self.k, self.gate = num_experts_per_tok, nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(num_experts))
        self.w2 = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(num_experts))
        self.w3 = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(num_experts))

    def forward(self, inputs):
        squashed = inputs.view(-1, inputs.shape[-1])
        weights, selected_experts = torch.topk(self.gate(squashed), self.k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).type_as(inputs)
        results = torch.zeros_like(squashed)
        for i, (w1, w2, w3) in enumerate(zip(self.w1, self.w2, self.w3)):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            rows = squashed[batch_idx]
            results[batch_idx] += weights[batch_idx, nth_expert, None] * w2(
                F.silu(w1(rows)) * w3(rows)
            )
        return results.view_as(inputs)


class MistralRMSNorm(nn.Module):
    """mistralai/mistral-src, ``one_file_ref.py``: ``RMSNorm`` (``_norm(x.float()).type_as(x)``)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


class Mixtral(nn.Module):
    """mistralai/mistral-src, ``moe_one_file_ref.py``: ``Transformer``, the sliding-window mask
    as ``log(triu(tril(ones), -sliding_window))``, the rotary table indexed by ``positions``,
    the logits ``.float()``."""

    def __init__(self, vocab=13, dim=8, n_layers=2, sliding_window=3):
        super().__init__()
        self.sliding_window = sliding_window
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.attention_norm = nn.ModuleList(MistralRMSNorm(dim) for _ in range(n_layers))
        self.attention = nn.ModuleList(
            MistralAttention(dim, sliding_window=sliding_window) for _ in range(n_layers)
        )
        self.ffn_norm = nn.ModuleList(MistralRMSNorm(dim) for _ in range(n_layers))
        self.feed_forward = nn.ModuleList(MistralMoeLayer(dim) for _ in range(n_layers))
        self.norm, self.output = MistralRMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.init_buffers()

    def init_buffers(self):
        """The complex rotary table, made again after ``.to(dtype)`` took it to real."""
        self.register_buffer("freqs_cis", precompute_freqs_cis(2, 16), persistent=False)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[positions]
        tensor = torch.full((len(positions), len(positions)), fill_value=1, dtype=h.dtype)
        mask = torch.log(torch.triu(torch.tril(tensor, diagonal=0), diagonal=-self.sliding_window))
        for an, att, fn, ff in zip(
            self.attention_norm, self.attention, self.ffn_norm, self.feed_forward
        ):
            h = h + att(an(h), freqs_cis, positions, mask)
            h = h + ff(fn(h))
        return self.output(self.norm(h)).float()


def mixtral():
    x, y = tokens()
    return Spec(Mixtral(), (x,), cross_entropy, (y,), rtol=1e-5)  # (rotary, softmax in float32)


def ds_apply_rotary_emb(x, freqs_cis):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``apply_rotary_emb``."""
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    return torch.view_as_real(x * freqs_cis).flatten(3).to(dtype)


class MLA(nn.Module):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``MLA`` as ``attn_impl == "naive"``
    runs it, the low-rank query and key-value projections, rotary on a part of each head, the
    keys and values written into caches of ``max_batch_size`` rows (``k_cache[:bsz,
    start_pos:end_pos] = k``) and the scores and output read back from them
    (``einsum(..., k_cache[:bsz, :end_pos])``), the softmax in float32."""

    def __init__(self, dim=8, n_heads=2, q_lora_rank=4, kv_lora_rank=4, nope=2, rope=2, v_head_dim=2,
                 max_batch_size=4, max_seq_len=8):  # fmt: skip
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_head_dim = n_heads, nope, rope, v_head_dim
        self.kv_lora_rank, self.qk_head_dim = kv_lora_rank, nope + rope
        self.wq_a, self.q_norm = nn.Linear(dim, q_lora_rank), nn.RMSNorm(q_lora_rank, eps=1e-6)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a, self.kv_norm = (
            nn.Linear(dim, kv_lora_rank + rope),
            nn.RMSNorm(kv_lora_rank, eps=1e-6),
        )
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (nope + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.softmax_scale = self.qk_head_dim**-0.5
        self.register_buffer(
            "k_cache",
            torch.zeros(max_batch_size, max_seq_len, n_heads, self.qk_head_dim),
            persistent=False,
        )
        self.register_buffer(
            "v_cache",
            torch.zeros(max_batch_size, max_seq_len, n_heads, v_head_dim),
            persistent=False,
        )

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        q_pe = ds_apply_rotary_emb(q_pe, freqs_cis)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope], dim=-1)
        k_pe = ds_apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(
            bsz, seqlen, self.n_heads, self.nope + self.v_head_dim
        )
        k_nope, v = torch.split(kv, [self.nope, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        self.k_cache[:bsz, start_pos:end_pos] = k
        self.v_cache[:bsz, start_pos:end_pos] = v
        scores = (
            torch.einsum("bshd,bthd->bsht", q, self.k_cache[:bsz, :end_pos]) * self.softmax_scale
        )
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,bthd->bshd", scores, self.v_cache[:bsz, :end_pos])
        return self.wo(x.flatten(2))


class DSGate(nn.Module):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``Gate``, its weight a parameter of its
    own (``matmul(x, self.weight.T)``), softmax scores in float32, the experts' groups ranked by
    their best score and the others masked out by ``zeros_like(...).scatter_(1, indices, 1)``,
    the top-k experts' scores gathered and scaled."""

    def __init__(self, dim=8, n_experts=4, n_groups=2, topk_groups=1, topk=2, route_scale=1.5):
        super().__init__()
        self.topk, self.n_groups, self.topk_groups, self.route_scale = (
            topk,
            n_groups,
            topk_groups,
            route_scale,
        )
        self.weight = nn.Parameter(0.3 * torch.randn(n_experts, dim))

    def forward(self, x):
        scores = torch.matmul(x, self.weight.T).softmax(dim=-1, dtype=torch.float32)
        scores = scores.view(x.size(0), self.n_groups, -1)
        indices = scores.amax(dim=-1).topk(self.topk_groups, dim=-1)[1]
        mask = torch.zeros_like(scores[..., 0]).scatter_(1, indices, 1)
        scores = (scores * mask.unsqueeze(-1)).flatten(1)
        indices = scores.topk(self.topk, dim=-1)[1]
        return (scores.gather(1, indices) * self.route_scale).type_as(x), indices


class DSMLP(nn.Module):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``MLP`` and ``Expert``."""

    def __init__(self, dim, inter_dim):
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(dim, inter_dim),
            nn.Linear(inter_dim, dim),
            nn.Linear(dim, inter_dim),
        )

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DSMoE(nn.Module):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``MoE``, the tokens' experts counted
    over the batch (``bincount(...).tolist()``) to skip those no token chose, each expert's
    rows added back by ``y[idx] += ...`` into ``zeros_like(x)``, shared experts on every
    token."""

    def __init__(self, dim=8, n_experts=4, inter_dim=6):
        super().__init__()
        self.dim, self.n_experts = dim, n_experts
        self.gate = DSGate(dim, n_experts)
        self.experts = nn.ModuleList(DSMLP(dim, inter_dim) for _ in range(n_experts))
        self.shared_experts = DSMLP(dim, inter_dim)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
        for i in range(self.n_experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class DeepSeekV3(nn.Module):
    """deepseek-ai/DeepSeek-V3, ``inference/model.py``: ``Transformer`` and ``Block`` (a dense
    layer, then a mixture of experts), the causal mask ``full(-inf).triu_(1)``, ``F.rms_norm``
    norms; trained on every position's logits (its generation reads the last one), the caches'
    graph of the step before dropped first."""

    def __init__(self, vocab=13, dim=8, max_seq_len=8, max_batch_size=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(MLA(dim, max_batch_size=max_batch_size) for _ in range(2))
        self.ffn = nn.ModuleList([DSMLP(dim, 12), DSMoE(dim)])
        self.attn_norm = nn.ModuleList(nn.RMSNorm(dim, eps=1e-6) for _ in range(2))
        self.ffn_norm = nn.ModuleList(nn.RMSNorm(dim, eps=1e-6) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(dim, eps=1e-6), nn.Linear(dim, vocab, bias=False)
        self.max_seq_len = max_seq_len
        self.init_buffers()

    def init_buffers(self):
        """The complex rotary table, made again after ``.to(dtype)`` took it to real."""
        freqs = (10000.0 ** (-torch.arange(0, 2, 2, dtype=torch.float32) / 2)).reciprocal()
        table = torch.polar(
            torch.ones((self.max_seq_len, len(freqs))),
            torch.outer(torch.arange(self.max_seq_len), freqs),
        )
        self.register_buffer("freqs_cis", table, persistent=False)

    def forward(self, tokens, start_pos=0):
        for attn in self.attn:  # (the step before's graph dropped: else its backward runs twice)
            attn.k_cache.detach_()
            attn.v_cache.detach_()
        seqlen = tokens.shape[1]
        h = self.embed(tokens)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf")).triu_(1)
        for attn, ffn, an, fn in zip(self.attn, self.ffn, self.attn_norm, self.ffn_norm):
            h = h + attn(an(h), start_pos, freqs_cis, mask)
            h = h + ffn(fn(h))
        return self.head(self.norm(h))


def deepseek_v3(max_batch_size=B):
    x, y = tokens()
    model = DeepSeekV3(max_batch_size=max_batch_size)
    return Spec(model, (x,), cross_entropy, (y,), rtol=1e-5)  # (rotary, softmax in float32)


# -- vision blocks ------------------------------------------------------------------------------


def window_partition(x, window_size):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``window_partition``, the
    windows of every image folded into the batch by view and permute."""
    B_, H, W, C = x.shape
    x = x.view(B_, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size, H, W):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``window_reverse``, the
    batch size computed back from the windows' count."""
    B_ = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.view(B_, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B_, H, W, -1)


class WindowAttention(nn.Module):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``WindowAttention``, a
    relative position bias table indexed by a buffer, the shifted windows' mask added after
    unfolding the windows from the batch (``attn.view(B_ // nW, nW, ...)``)."""

    def __init__(self, dim, window_size, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(
            0.02 * torch.randn((2 * window_size - 1) ** 2, num_heads)
        )
        coords = torch.stack(
            torch.meshgrid([torch.arange(window_size)] * 2, indexing="ij")
        ).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += window_size - 1
        relative[:, :, 1] += window_size - 1
        relative[:, :, 0] *= 2 * window_size - 1
        self.register_buffer("relative_position_index", relative.sum(-1))
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = (
            self.qkv(x)
            .reshape(B_, N, 3, self.num_heads, C // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            N, N, -1
        )
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B_, N, C))


class SwinBlock(nn.Module):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``SwinTransformerBlock``,
    the image rolled by ``torch.roll`` before its windows are taken and rolled back after,
    the mask of the shifted windows made once as a buffer."""

    def __init__(self, dim, resolution, num_heads, window_size, shift_size):
        super().__init__()
        self.resolution, self.window_size, self.shift_size = resolution, window_size, shift_size
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window_size, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        attn_mask = None
        if shift_size > 0:
            H = W = resolution
            img_mask = torch.zeros((1, H, W, 1))
            slices = (
                slice(0, -window_size),
                slice(-window_size, -shift_size),
                slice(-shift_size, None),
            )
            cnt = 0
            for h in slices:
                for w in slices:
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, window_size).view(
                -1, window_size * window_size
            )
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(
                attn_mask == 0, 0.0
            )
        self.register_buffer("attn_mask", attn_mask)

    def forward(self, x):
        H = W = self.resolution
        B_, L, C = x.shape
        shortcut, ws = x, self.window_size
        x = self.norm1(x).view(B_, H, W, C)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = window_partition(x, ws).view(-1, ws * ws, C)
        windows = self.attn(windows, mask=self.attn_mask).view(-1, ws, ws, C)
        x = window_reverse(windows, ws, H, W)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        x = shortcut + x.view(B_, H * W, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``PatchMerging``, four
    strided slices concatenated, normed and reduced."""

    def __init__(self, resolution, dim):
        super().__init__()
        self.resolution = resolution
        self.reduction, self.norm = nn.Linear(4 * dim, 2 * dim, bias=False), nn.LayerNorm(4 * dim)

    def forward(self, x):
        B_, _, C = x.shape
        x = x.view(B_, self.resolution, self.resolution, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B_, -1, 4 * C)))


class Swin(nn.Module):
    """microsoft/Swin-Transformer, ``models/swin_transformer.py``: ``SwinTransformer`` (patch
    embedding by a strided convolution and LayerNorm, a regular and a shifted block, patch
    merging, average pooling over tokens, a head)."""

    def __init__(self, dim=8, classes=3):
        super().__init__()
        self.patch_embed, self.patch_norm = nn.Conv2d(3, dim, 2, stride=2), nn.LayerNorm(dim)
        self.blocks = nn.Sequential(SwinBlock(dim, 4, 2, 2, 0), SwinBlock(dim, 4, 2, 2, 1))
        self.merge = PatchMerging(4, dim)
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, classes)

    def forward(self, x):
        x = self.patch_norm(self.patch_embed(x).flatten(2).transpose(1, 2))
        x = self.norm(self.merge(self.blocks(x)))
        return self.head(torch.flatten(F.adaptive_avg_pool1d(x.transpose(1, 2), 1), 1))


def image_batch(side=8, classes=3, channels=3):
    return torch.randn(B, channels, side, side), torch.randint(classes, (B,))


def swin():
    x, y = image_batch()
    return Spec(Swin(), (x,), cross_entropy, (y,))


class WindowAttentionV2(nn.Module):
    """microsoft/Swin-Transformer, ``models/swin_transformer_v2.py``: ``WindowAttention``, cosine
    attention scaled by a clamped learned ``logit_scale``, the relative position bias made by an
    MLP (``cpb_mlp``) of a log-spaced coordinate table (a batch-free call, its output added to
    every window's scores), the projection ``F.linear(input=x, weight=self.qkv.weight,
    bias=qkv_bias)`` with a bias joined from ``q_bias``, zeros and ``v_bias``."""

    def __init__(self, dim, window_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))))
        self.cpb_mlp = nn.Sequential(
            nn.Linear(2, 16), nn.ReLU(inplace=True), nn.Linear(16, num_heads, bias=False)
        )
        h = torch.arange(-(window_size - 1), window_size, dtype=torch.float32)
        table = (
            torch.stack(torch.meshgrid([h, h], indexing="ij"))
            .permute(1, 2, 0)
            .contiguous()
            .unsqueeze(0)
        )
        table = table / (window_size - 1) * 8
        table = torch.sign(table) * torch.log2(torch.abs(table) + 1.0) / math.log2(8)
        self.register_buffer("relative_coords_table", table)
        coords = torch.stack(
            torch.meshgrid([torch.arange(window_size)] * 2, indexing="ij")
        ).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += window_size - 1
        relative[:, :, 1] += window_size - 1
        relative[:, :, 0] *= 2 * window_size - 1
        self.register_buffer("relative_position_index", relative.sum(-1))
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias, self.v_bias = (
            nn.Parameter(0.1 * torch.randn(dim)),
            nn.Parameter(0.1 * torch.randn(dim)),
        )
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv_bias = torch.cat(
            (self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias)
        )
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=torch.log(torch.tensor(1.0 / 0.01))).exp()
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = (
            table[self.relative_position_index.view(-1)]
            .view(N, N, -1)
            .permute(2, 0, 1)
            .contiguous()
        )
        attn = attn + 16 * torch.sigmoid(bias).unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B_, N, C))


class SwinV2Block(SwinBlock):
    """microsoft/Swin-Transformer, ``models/swin_transformer_v2.py``: ``SwinTransformerBlock``,
    the norms after attention and MLP (``x = shortcut + norm1(attn(x))``)."""

    def __init__(self, dim, resolution, num_heads, window_size, shift_size):
        super().__init__(dim, resolution, num_heads, window_size, shift_size)
        self.attn = WindowAttentionV2(dim, window_size, num_heads)

    def forward(self, x):
        H = W = self.resolution
        B_, L, C = x.shape
        ws = self.window_size
        y = x.view(B_, H, W, C)
        if self.shift_size > 0:
            y = torch.roll(y, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = self.attn(window_partition(y, ws).view(-1, ws * ws, C), mask=self.attn_mask)
        y = window_reverse(windows.view(-1, ws, ws, C), ws, H, W)
        if self.shift_size > 0:
            y = torch.roll(y, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        x = x + self.norm1(y.reshape(B_, H * W, C))
        return x + self.norm2(self.mlp(x))


def swin_v2():
    x, y = image_batch()
    model = Swin()
    model.blocks = nn.Sequential(SwinV2Block(8, 4, 2, 2, 0), SwinV2Block(8, 4, 2, 2, 1))
    return Spec(model, (x,), cross_entropy, (y,), rtol=1e-6)  # (the coordinate table in float32)


class PoolFormerBlock(nn.Module):
    """sail-sg/poolformer, ``models/poolformer.py``: ``PoolFormerBlock``, the token mixer
    ``pool(x) - x`` (average pooling without the padding), GroupNorm of one group, MLP by 1x1
    convolutions, layer scales as the block's own parameters."""

    def __init__(self, dim, pool_size=3, layer_scale_init_value=1e-1):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(1, dim), nn.GroupNorm(1, dim)
        self.pool = nn.AvgPool2d(
            pool_size, stride=1, padding=pool_size // 2, count_include_pad=False
        )
        self.mlp = nn.Sequential(nn.Conv2d(dim, 2 * dim, 1), nn.GELU(), nn.Conv2d(2 * dim, dim, 1))
        self.layer_scale_1 = nn.Parameter(layer_scale_init_value * torch.ones(dim))
        self.layer_scale_2 = nn.Parameter(layer_scale_init_value * torch.ones(dim))

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.layer_scale_1.unsqueeze(-1).unsqueeze(-1) * (self.pool(y) - y)
        return x + self.layer_scale_2.unsqueeze(-1).unsqueeze(-1) * self.mlp(self.norm2(x))


class PoolFormer(nn.Module):
    """sail-sg/poolformer, ``models/poolformer.py``: ``PoolFormer``, patch embeddings by
    overlapping strided convolutions between stages, GroupNorm and global mean before the
    head."""

    def __init__(self, dims=(4, 8), classes=3):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dims[0], 3, stride=2, padding=1)
        self.stage1 = PoolFormerBlock(dims[0])
        self.downsample = nn.Conv2d(dims[0], dims[1], 3, stride=2, padding=1)
        self.stage2 = PoolFormerBlock(dims[1])
        self.norm, self.head = nn.GroupNorm(1, dims[1]), nn.Linear(dims[1], classes)

    def forward(self, x):
        x = self.stage2(self.downsample(self.stage1(self.patch_embed(x))))
        return self.head(self.norm(x).mean([-2, -1]))


def poolformer():
    x, y = image_batch()
    return Spec(PoolFormer(), (x,), cross_entropy, (y,))


class SwishImplementation(torch.autograd.Function):
    """lukemelas/EfficientNet-PyTorch, ``efficientnet_pytorch/utils.py``: the memory-efficient
    swish, its derivative written by hand."""

    @staticmethod
    def forward(ctx, i):
        ctx.save_for_backward(i)
        return i * torch.sigmoid(i)

    @staticmethod
    def backward(ctx, grad_output):
        (i,) = ctx.saved_tensors
        sigmoid_i = torch.sigmoid(i)
        return grad_output * (sigmoid_i * (1 + i * (1 - sigmoid_i)))


class MemoryEfficientSwish(nn.Module):
    def forward(self, x):
        return SwishImplementation.apply(x)


class Conv2dDynamicSamePadding(nn.Conv2d):
    """lukemelas/EfficientNet-PyTorch, ``efficientnet_pytorch/utils.py``: TensorFlow's "same"
    padding computed from each input's size, ``F.pad`` then ``F.conv2d`` with the module's
    weight: a ``Conv2d`` whose ``forward`` is its own."""

    def forward(self, x):
        ih, iw = x.size()[-2:]
        kh, kw = self.weight.size()[-2:]
        sh, sw = self.stride
        oh, ow = math.ceil(ih / sh), math.ceil(iw / sw)
        pad_h = max((oh - 1) * self.stride[0] + (kh - 1) * self.dilation[0] + 1 - ih, 0)
        pad_w = max((ow - 1) * self.stride[1] + (kw - 1) * self.dilation[1] + 1 - iw, 0)
        if pad_h > 0 or pad_w > 0:
            x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return F.conv2d(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


class MBConvBlock(nn.Module):
    """lukemelas/EfficientNet-PyTorch, ``efficientnet_pytorch/model.py``: ``MBConvBlock``
    (expansion, depthwise convolution, squeeze-and-excitation by ``adaptive_avg_pool2d`` and
    two 1x1 convolutions, projection, the identity skip), without drop-connect (its draw per
    example is not the loop's)."""

    def __init__(self, cin, cout, expand_ratio=3, kernel_size=3, stride=1, se_ratio=0.25):
        super().__init__()
        mid, squeezed = cin * expand_ratio, max(1, int(cin * se_ratio))
        self.id_skip = stride == 1 and cin == cout
        self._expand_conv = Conv2dDynamicSamePadding(cin, mid, 1, bias=False)
        self._bn0 = nn.BatchNorm2d(mid)
        self._depthwise_conv = Conv2dDynamicSamePadding(
            mid, mid, kernel_size, stride=stride, groups=mid, bias=False
        )
        self._bn1 = nn.BatchNorm2d(mid)
        self._se_reduce = Conv2dDynamicSamePadding(mid, squeezed, 1)
        self._se_expand = Conv2dDynamicSamePadding(squeezed, mid, 1)
        self._project_conv = Conv2dDynamicSamePadding(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout)
        self._swish = MemoryEfficientSwish()

    def forward(self, inputs):
        x = self._swish(self._bn0(self._expand_conv(inputs)))
        x = self._swish(self._bn1(self._depthwise_conv(x)))
        x_squeezed = self._se_expand(self._swish(self._se_reduce(F.adaptive_avg_pool2d(x, 1))))
        x = self._bn2(self._project_conv(torch.sigmoid(x_squeezed) * x))
        return x + inputs if self.id_skip else x


class EfficientNet(nn.Module):
    """lukemelas/EfficientNet-PyTorch, ``efficientnet_pytorch/model.py``: ``EfficientNet``,
    stem, MBConv blocks, head convolution, pooling and the classifier; fine-tuned with its
    batch norms frozen."""

    def __init__(self, classes=3):
        super().__init__()
        self._conv_stem = Conv2dDynamicSamePadding(3, 4, 3, stride=2, bias=False)
        self._bn0 = nn.BatchNorm2d(4)
        self._blocks = nn.Sequential(MBConvBlock(4, 4), MBConvBlock(4, 6, stride=2))
        self._conv_head, self._bn1 = (
            Conv2dDynamicSamePadding(6, 8, 1, bias=False),
            nn.BatchNorm2d(8),
        )
        self._fc, self._swish = nn.Linear(8, classes), MemoryEfficientSwish()

    def forward(self, x):
        x = self._blocks(self._swish(self._bn0(self._conv_stem(x))))
        x = self._swish(self._bn1(self._conv_head(x)))
        return self._fc(F.adaptive_avg_pool2d(x, 1).flatten(start_dim=1))


def efficientnet():
    x, y = image_batch(side=7)  # (odd: the "same" padding is uneven)
    return Spec(EfficientNet(), (x,), cross_entropy, (y,), bn_eval=True)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def ConvMixer(dim=8, depth=2, kernel_size=3, patch_size=2, n_classes=3):  # noqa: N802
    """locuslab/convmixer, ``convmixer.py``: ``ConvMixer``, depthwise convolutions of "same"
    padding in residuals, pointwise ones, each followed by GELU and BatchNorm2d."""
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size), nn.GELU(), nn.BatchNorm2d(dim),
        *[nn.Sequential(
            Residual(nn.Sequential(nn.Conv2d(dim, dim, kernel_size, groups=dim, padding="same"),
                                   nn.GELU(), nn.BatchNorm2d(dim))),
            nn.Conv2d(dim, dim, kernel_size=1), nn.GELU(), nn.BatchNorm2d(dim))
          for _ in range(depth)],
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(dim, n_classes),
    )  # fmt: skip


def convmixer(bn_eval=True):
    x, y = image_batch()
    return Spec(ConvMixer(), (x,), cross_entropy, (y,), bn_eval=bn_eval)


class CoAtNetAttention(nn.Module):
    """chinhsuanwu/coatnet-pytorch, ``coatnet.py``: ``Attention``, the relative bias table a
    parameter of the block read by ``gather`` with an index buffer ``repeat``ed over the heads,
    the queries, keys and values split by ``chunk`` and einops' ``rearrange``."""

    def __init__(self, inp, oup, image_size, heads=2, dim_head=4):
        super().__init__()
        self.ih = self.iw = image_size
        self.heads, self.scale = heads, dim_head**-0.5
        self.relative_bias_table = nn.Parameter(
            0.02 * torch.randn((2 * self.ih - 1) * (2 * self.iw - 1), heads)
        )
        coords = torch.flatten(torch.stack(torch.meshgrid(torch.arange(self.ih), torch.arange(self.iw),
                                                          indexing="ij")), 1)  # fmt: skip
        relative_coords = coords[:, :, None] - coords[:, None, :]
        relative_coords[0] += self.ih - 1
        relative_coords[1] += self.iw - 1
        relative_coords[0] *= 2 * self.iw - 1
        relative_index = rearrange(relative_coords, "c h w -> h w c").sum(-1).flatten().unsqueeze(1)
        self.register_buffer("relative_index", relative_index)
        self.to_qkv = nn.Linear(inp, heads * dim_head * 3, bias=False)
        self.to_out = nn.Linear(heads * dim_head, oup)

    def forward(self, x):
        q, k, v = (
            rearrange(t, "b n (h d) -> b h n d", h=self.heads)
            for t in self.to_qkv(x).chunk(3, dim=-1)
        )
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        relative_bias = self.relative_bias_table.gather(
            0, self.relative_index.repeat(1, self.heads)
        )
        n = self.ih * self.iw
        dots = dots + rearrange(relative_bias, "(h w) c -> 1 c h w", h=n, w=n)
        out = torch.matmul(dots.softmax(dim=-1), v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class CoAtNetTransformer(nn.Module):
    """chinhsuanwu/coatnet-pytorch, ``coatnet.py``: ``Transformer``, downsampling by max
    pooling on both branches (the shortcut projected by a 1x1 convolution), pre-norm attention
    and feedforward on the image rearranged to tokens and back."""

    def __init__(self, inp, oup, image_size, downsample=False):
        super().__init__()
        self.ih = self.iw = image_size
        self.downsample = downsample
        if downsample:
            self.pool1, self.pool2 = nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, 1)
            self.proj = nn.Conv2d(inp, oup, 1, 1, 0, bias=False)
        self.norm1, self.attn = nn.LayerNorm(inp), CoAtNetAttention(inp, oup, image_size)
        self.norm2 = nn.LayerNorm(oup)
        self.ff = nn.Sequential(nn.Linear(oup, 2 * oup), nn.GELU(), nn.Linear(2 * oup, oup))

    def tokens(self, fn, norm, x):
        y = fn(norm(rearrange(x, "b c ih iw -> b (ih iw) c")))
        return rearrange(y, "b (ih iw) c -> b c ih iw", ih=self.ih, iw=self.iw)

    def forward(self, x):
        if self.downsample:
            x = self.proj(self.pool1(x)) + self.tokens(self.attn, self.norm1, self.pool2(x))
        else:
            x = x + self.tokens(self.attn, self.norm1, x)
        return x + self.tokens(self.ff, self.norm2, x)


class CoAtNet(nn.Module):
    """chinhsuanwu/coatnet-pytorch, ``coatnet.py``: ``CoAtNet``'s stem (``conv_3x3_bn``, its
    batch norm frozen), transformer stages, average pooling and the classifier."""

    def __init__(self, classes=3):
        super().__init__()
        self.s0 = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.GELU())
        self.s3 = nn.Sequential(
            CoAtNetTransformer(4, 8, 2, downsample=True), CoAtNetTransformer(8, 8, 2)
        )
        self.fc = nn.Linear(8, classes, bias=False)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.s3(self.s0(x)), 1).view(-1, 8))


def coatnet():
    x, y = image_batch()
    return Spec(CoAtNet(), (x,), cross_entropy, (y,), bn_eval=True)


def square_distance(src, dst):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_utils.py``: ``square_distance``."""
    B_, N, _ = src.shape
    _, M, _ = dst.shape
    dist = -2 * torch.matmul(src, dst.permute(0, 2, 1))
    dist += torch.sum(src**2, -1).view(B_, N, 1)
    dist += torch.sum(dst**2, -1).view(B_, 1, M)
    return dist


def index_points(points, idx):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_utils.py``: ``index_points``,
    ``points[batch_indices, idx, :]`` with ``batch_indices`` an ``arange(B)`` repeated."""
    B_ = points.shape[0]
    view_shape = list(idx.shape)
    view_shape[1:] = [1] * (len(view_shape) - 1)
    repeat_shape = list(idx.shape)
    repeat_shape[0] = 1
    batch_indices = torch.arange(B_, dtype=torch.long).view(view_shape).repeat(repeat_shape)
    return points[batch_indices, idx, :]


def farthest_point_sample(xyz, npoint):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_utils.py``:
    ``farthest_point_sample``, from each cloud's first point (drawn at random there: the loop
    would draw others)."""
    B_, N, _ = xyz.shape
    centroids = torch.zeros(B_, npoint, dtype=torch.long)
    distance = torch.ones(B_, N, dtype=xyz.dtype) * 1e10
    farthest = torch.zeros(B_, dtype=torch.long)
    batch_indices = torch.arange(B_, dtype=torch.long)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_indices, farthest, :].view(B_, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        mask = dist < distance
        distance[mask] = dist[mask]
        farthest = torch.max(distance, -1)[1]
    return centroids


def query_ball_point(radius, nsample, xyz, new_xyz):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_utils.py``: ``query_ball_point``,
    points past the radius set to ``N`` in place, sorted, the first ``nsample`` kept, the
    missing ones replaced by each group's first by a mask."""
    B_, N, _ = xyz.shape
    _, S, _ = new_xyz.shape
    group_idx = torch.arange(N, dtype=torch.long).view(1, 1, N).repeat([B_, S, 1])
    sqrdists = square_distance(new_xyz, xyz)
    group_idx[sqrdists > radius**2] = N
    group_idx = group_idx.sort(dim=-1)[0][:, :, :nsample]
    group_first = group_idx[:, :, 0].view(B_, S, 1).repeat([1, 1, nsample])
    mask = group_idx == N
    group_idx[mask] = group_first[mask]
    return group_idx


class PointNetSetAbstraction(nn.Module):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_utils.py``:
    ``PointNetSetAbstraction`` (``sample_and_group``: centroids by farthest point sampling,
    neighbourhoods by ball query, each point's offset from its centroid beside its features,
    shared 1x1 convolutions with batch norms (frozen), a max over each group)."""

    def __init__(self, npoint, radius, nsample, in_channel, mlp, group_all=False):
        super().__init__()
        self.npoint, self.radius, self.nsample, self.group_all = npoint, radius, nsample, group_all
        self.mlp_convs, self.mlp_bns = nn.ModuleList(), nn.ModuleList()
        last = in_channel
        for out_channel in mlp:
            self.mlp_convs.append(nn.Conv2d(last, out_channel, 1))
            self.mlp_bns.append(nn.BatchNorm2d(out_channel))
            last = out_channel

    def forward(self, xyz, points):
        xyz = xyz.permute(0, 2, 1)
        if points is not None:
            points = points.permute(0, 2, 1)
        if self.group_all:
            new_xyz = torch.zeros(xyz.shape[0], 1, 3, dtype=xyz.dtype)
            grouped = xyz.view(xyz.shape[0], 1, xyz.shape[1], 3)
            new_points = (
                grouped
                if points is None
                else torch.cat([grouped, points.view(*grouped.shape[:3], -1)], -1)
            )
        else:
            new_xyz = index_points(xyz, farthest_point_sample(xyz, self.npoint))
            idx = query_ball_point(self.radius, self.nsample, xyz, new_xyz)
            grouped_xyz = index_points(xyz, idx) - new_xyz.view(xyz.shape[0], self.npoint, 1, 3)
            new_points = (
                grouped_xyz
                if points is None
                else torch.cat([grouped_xyz, index_points(points, idx)], -1)
            )
        new_points = new_points.permute(0, 3, 2, 1)
        for conv, bn in zip(self.mlp_convs, self.mlp_bns):
            new_points = F.relu(bn(conv(new_points)))
        return new_xyz.permute(0, 2, 1), torch.max(new_points, 2)[0]


class PointNet2(nn.Module):
    """yanx27/Pointnet_Pointnet2_pytorch, ``models/pointnet2_cls_ssg.py``: ``get_model``, two
    set abstractions (the second over all points) and a classifier (its batch norm frozen)."""

    def __init__(self, classes=3):
        super().__init__()
        self.sa1 = PointNetSetAbstraction(4, 0.8, 3, 3, [4, 6])
        self.sa2 = PointNetSetAbstraction(None, None, None, 6 + 3, [8], group_all=True)
        self.fc1, self.bn1, self.fc2 = nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, classes)

    def forward(self, xyz):
        l1_xyz, l1_points = self.sa1(xyz, None)
        _, l2_points = self.sa2(l1_xyz, l1_points)
        x = F.relu(self.bn1(self.fc1(l2_points.view(xyz.shape[0], 8))))
        return F.log_softmax(self.fc2(x), -1)


def pointnet2():
    out_nll = lambda out, y: -out.gather(1, y[:, None]).squeeze(1)  # noqa: E731
    return Spec(
        PointNet2(), (torch.randn(B, 3, 10),), out_nll, (torch.randint(3, (B,)),), bn_eval=True
    )


# -- time series --------------------------------------------------------------------------------


class IdentityBasis(nn.Module):
    """cchallu/n-hits, ``src/models/nhits/nhits.py``: ``_IdentityBasis``, the forecast's
    knots interpolated to the horizon by ``F.interpolate``."""

    def __init__(self, backcast_size, forecast_size, interpolation_mode):
        super().__init__()
        self.backcast_size, self.forecast_size, self.mode = (
            backcast_size,
            forecast_size,
            interpolation_mode,
        )

    def forward(self, theta):
        backcast, knots = theta[:, : self.backcast_size], theta[:, self.backcast_size :]
        forecast = F.interpolate(knots[:, None, :], size=self.forecast_size, mode=self.mode)
        return backcast, forecast[:, 0, :]


class NHiTSBlock(nn.Module):
    """cchallu/n-hits, ``src/models/nhits/nhits.py``: ``_NHITSBlock``, the input max-pooled
    (``ceil_mode=True``) before an MLP whose output is the backcast and the knots."""

    def __init__(self, input_size, horizon, pool, n_knots, mode, hidden=8):
        super().__init__()
        self.pooling_layer = nn.MaxPool1d(pool, stride=pool, ceil_mode=True)
        pooled = math.ceil(input_size / pool)
        self.layers = nn.Sequential(nn.Linear(pooled, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, input_size + n_knots))  # fmt: skip
        self.basis = IdentityBasis(input_size, horizon, mode)

    def forward(self, insample_y):
        insample_y = self.pooling_layer(insample_y.unsqueeze(1)).squeeze(1)
        return self.basis(self.layers(insample_y))


class NHiTS(nn.Module):
    """cchallu/n-hits, ``src/models/nhits/nhits.py``: ``_NHITS``, the input flipped, each
    block's backcast taken off the masked residuals, the forecasts added to the last value."""

    def __init__(self, input_size=10, horizon=4):
        super().__init__()
        self.blocks = nn.ModuleList([NHiTSBlock(input_size, horizon, 4, 2, "linear"),
                                     NHiTSBlock(input_size, horizon, 2, 2, "nearest"),
                                     NHiTSBlock(input_size, horizon, 1, 4, "linear")])  # fmt: skip

    def forward(self, insample_y, insample_mask):
        residuals, insample_mask = insample_y.flip(dims=(-1,)), insample_mask.flip(dims=(-1,))
        forecast = insample_y[:, -1:]
        for block in self.blocks:
            backcast, block_forecast = block(residuals)
            residuals = (residuals - backcast) * insample_mask
            forecast = forecast + block_forecast
        return forecast


def nhits():
    mask = torch.ones(B, 10)
    mask[0, :3] = 0  # (a series shorter than the window)
    return Spec(NHiTS(), (torch.randn(B, 10), mask), mse, (torch.randn(B, 4),))


class ProbAttention(nn.Module):
    """zhouhaoyi/Informer2020, ``models/attn.py``: ``ProbAttention``, each query's sparsity
    measured on a sample of keys (drawn here by a generator of a fixed seed, the same for the
    batch and for each example alone), each example's top queries picked by
    ``Q[arange(B)[:, None, None], arange(H)[None, :, None], M_top]``, attended, and written into
    the mean (or cumulative sum, under the mask) of the values by the same index, in place;
    ``ProbMask`` picks the causal mask's rows the same way."""

    def __init__(self, mask_flag, factor=1):
        super().__init__()
        self.mask_flag, self.factor = mask_flag, factor

    def _prob_QK(self, Q, K, sample_k, n_top):  # noqa: N802, N803
        B_, H, L_K, E = K.shape
        L_Q = Q.shape[2]
        K_expand = K.unsqueeze(-3).expand(B_, H, L_Q, L_K, E)
        index_sample = torch.randint(
            L_K, (L_Q, sample_k), generator=torch.Generator().manual_seed(0)
        )
        K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]
        Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
        M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), L_K)
        M_top = M.topk(n_top, sorted=False)[1]
        Q_reduce = Q[torch.arange(B_)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
        return torch.matmul(Q_reduce, K.transpose(-2, -1)), M_top

    def forward(self, queries, keys, values):
        B_, L_Q, H, D = queries.shape
        L_K = keys.shape[1]
        queries, keys, values = (
            queries.transpose(2, 1),
            keys.transpose(2, 1),
            values.transpose(2, 1),
        )
        U_part = min(self.factor * int(math.ceil(math.log(L_K))), L_K)
        u = min(self.factor * int(math.ceil(math.log(L_Q))), L_Q)
        scores_top, index = self._prob_QK(queries, keys, sample_k=U_part, n_top=u)
        scores_top = scores_top * (1.0 / math.sqrt(D))
        if self.mask_flag:
            context = values.cumsum(dim=-2)
            _mask = torch.ones(L_Q, scores_top.shape[-1], dtype=torch.bool).triu(1)
            _mask_ex = _mask[None, None, :].expand(B_, H, L_Q, scores_top.shape[-1])
            indicator = _mask_ex[
                torch.arange(B_)[:, None, None], torch.arange(H)[None, :, None], index, :
            ]
            scores_top.masked_fill_(indicator.view(scores_top.shape), -math.inf)
        else:
            context = values.mean(dim=-2).unsqueeze(-2).expand(B_, H, L_Q, D).clone()
        attn = torch.softmax(scores_top, dim=-1)
        context[torch.arange(B_)[:, None, None], torch.arange(H)[None, :, None], index, :] = (
            torch.matmul(attn, values).type_as(context)
        )
        return context.transpose(2, 1).contiguous()


class AttentionLayer(nn.Module):
    """zhouhaoyi/Informer2020, ``models/attn.py``: ``AttentionLayer``."""

    def __init__(self, attention, d_model, n_heads):
        super().__init__()
        self.inner_attention, self.n_heads = attention, n_heads
        self.query_projection = nn.Linear(d_model, d_model)
        self.key_projection = nn.Linear(d_model, d_model)
        self.value_projection = nn.Linear(d_model, d_model)
        self.out_projection = nn.Linear(d_model, d_model)

    def forward(self, x):
        B_, L, _ = x.shape
        H = self.n_heads
        out = self.inner_attention(self.query_projection(x).view(B_, L, H, -1),
                                   self.key_projection(x).view(B_, L, H, -1),
                                   self.value_projection(x).view(B_, L, H, -1))  # fmt: skip
        return self.out_projection(out.view(B_, L, -1))


class InformerEncoderLayer(nn.Module):
    """zhouhaoyi/Informer2020, ``models/encoder.py``: ``EncoderLayer``, its feedforward by
    1x1 convolutions over the transposed sequence."""

    def __init__(self, attention, d_model):
        super().__init__()
        self.attention = attention
        self.conv1, self.conv2 = (
            nn.Conv1d(d_model, 2 * d_model, 1),
            nn.Conv1d(2 * d_model, d_model, 1),
        )
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        y = self.conv2(F.gelu(self.conv1(x.transpose(-1, 1)))).transpose(-1, 1)
        return self.norm2(x + y)


class Informer(nn.Module):
    """zhouhaoyi/Informer2020, ``models/embed.py`` and ``models/model.py``: the value embedding
    a circular-padded convolution (``TokenEmbedding``), a ProbSparse encoder layer, a masked
    ProbSparse one (the decoder's self-attention), a projection of the last steps."""

    def __init__(self, c_in=2, d_model=8, n_heads=2, pred_len=3):
        super().__init__()
        self.pred_len = pred_len
        self.tokenConv = nn.Conv1d(c_in, d_model, 3, padding=1, padding_mode="circular")
        self.encoder = InformerEncoderLayer(
            AttentionLayer(ProbAttention(False), d_model, n_heads), d_model
        )
        self.decoder = InformerEncoderLayer(
            AttentionLayer(ProbAttention(True), d_model, n_heads), d_model
        )
        self.projection = nn.Linear(d_model, c_in)

    def forward(self, x_enc):
        x = self.tokenConv(x_enc.permute(0, 2, 1)).transpose(1, 2)
        return self.projection(self.decoder(self.encoder(x)))[:, -self.pred_len :, :]


def informer():
    return Spec(Informer(), (torch.randn(B, 8, 2),), mse, (torch.randn(B, 3, 2),))


class DeepAR(nn.Module):
    """zhykoties/TimeSeries, ``model/net.py`` and ``train.py``: DeepAR's ``Net``, a
    sequence-first LSTM stepped one time step at a time from ``(hidden, cell)``, each series'
    embedding beside its value and covariates, ``mu`` and softplus ``sigma`` from every layer's
    hidden state (``hidden.permute(1, 2, 0)``); as its training loop runs it, a missing value
    (zero) replaced by the last step's ``mu`` (``train_batch[t, zero_index, 0] =
    mu[zero_index]``), and each step's Gaussian likelihood of the observed labels."""

    def __init__(self, num_class=4, cov_dim=1, embedding_dim=2, hidden=5, layers=2):
        super().__init__()
        self.layers, self.hidden = layers, hidden
        self.embedding = nn.Embedding(num_class, embedding_dim)
        self.lstm = nn.LSTM(1 + cov_dim + embedding_dim, hidden, num_layers=layers)
        with torch.no_grad():
            for names in self.lstm._all_weights:
                for name in filter(lambda n: "bias" in n, names):
                    bias = getattr(self.lstm, name)
                    bias[bias.size(0) // 4 : bias.size(0) // 2].fill_(1.0)
        self.distribution_mu = nn.Linear(hidden * layers, 1)
        self.distribution_presigma = nn.Linear(hidden * layers, 1)
        self.distribution_sigma = nn.Softplus()

    def step(self, x, idx, hidden, cell):
        lstm_input = torch.cat((x, self.embedding(idx)), dim=2)
        _, (hidden, cell) = self.lstm(lstm_input, (hidden, cell))
        hidden_permute = hidden.permute(1, 2, 0).contiguous().view(hidden.shape[1], -1)
        mu = self.distribution_mu(hidden_permute)
        sigma = self.distribution_sigma(self.distribution_presigma(hidden_permute))
        return mu.squeeze(-1), sigma.squeeze(-1), hidden, cell

    def forward(self, train_batch, idx, labels_batch):
        train_batch = train_batch.permute(1, 0, 2).clone()  # [time, batch, 1 + covariates]
        labels_batch = labels_batch.permute(1, 0)
        hidden = torch.zeros(
            self.layers, train_batch.shape[1], self.hidden, dtype=train_batch.dtype
        )
        cell = torch.zeros_like(hidden)
        losses = []
        for t in range(train_batch.shape[0]):
            zero_index = train_batch[t, :, 0] == 0
            if t > 0 and torch.sum(zero_index) > 0:
                train_batch[t, zero_index, 0] = mu[zero_index]  # noqa: F821 (the last step's)
            mu, sigma, hidden, cell = self.step(
                train_batch[t].unsqueeze(0).clone(), idx.unsqueeze(0), hidden, cell
            )
            labels = labels_batch[t]
            losses.append(-Normal(mu, sigma).log_prob(labels) * (labels != 0))
        return torch.stack(losses, 1).sum(1)  # (each series' own)


def deepar():
    values = torch.randn(B, 6, 2)
    values[1, 2:4, 0] = 0  # (missing)
    labels = torch.randn(B, 6)
    labels[2, 0] = 0
    return Spec(DeepAR(), (values, torch.tensor([0, 3, 1]), labels), lambda losses: losses)


# -- recommendation -----------------------------------------------------------------------------


class BERT4RecLayerNorm(nn.Module):
    """jaywonchung/BERT4Rec-VAE-Pytorch, ``models/bert_modules/utils/layer_norm.py``: by the
    unbiased standard deviation, ``a_2`` and ``b_2``."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2, self.b_2, self.eps = (
            nn.Parameter(torch.ones(features)),
            nn.Parameter(torch.zeros(features)),
            eps,
        )

    def forward(self, x):
        mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class BERT4RecBlock(nn.Module):
    """jaywonchung/BERT4Rec-VAE-Pytorch, ``models/bert_modules/transformer.py`` and
    ``attention/``: ``TransformerBlock`` (sublayer connections with pre-norm), multi-headed
    attention whose padding mask is ``masked_fill(mask == 0, -1e9)``, GELU written out."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.h, self.d_k = heads, hidden // heads
        self.linear_layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(3))
        self.output_linear = nn.Linear(hidden, hidden)
        self.w_1, self.w_2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.norm1, self.norm2 = BERT4RecLayerNorm(hidden), BERT4RecLayerNorm(hidden)

    def attention(self, x, mask):
        batch_size = x.size(0)
        q, k, v = (
            lin(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
            for lin in self.linear_layers
        )
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        p_attn = F.softmax(scores.masked_fill(mask == 0, -1e9), dim=-1)
        x = (
            torch.matmul(p_attn, v)
            .transpose(1, 2)
            .contiguous()
            .view(batch_size, -1, self.h * self.d_k)
        )
        return self.output_linear(x)

    def forward(self, x, mask):
        x = x + self.attention(self.norm1(x), mask)
        h = self.w_1(self.norm2(x))
        return x + self.w_2(
            0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * torch.pow(h, 3))))
        )


class BERT4Rec(nn.Module):
    """jaywonchung/BERT4Rec-VAE-Pytorch, ``models/bert_modules/bert.py`` and
    ``embedding/``: ``BERT``, the padding mask ``(x > 0).unsqueeze(1).repeat(1, x.size(1),
    1).unsqueeze(1)``, the positional embedding's weight itself ``repeat``ed over the batch
    (``pe.weight.unsqueeze(0).repeat(batch_size, 1, 1)``), the items' scores by a Linear."""

    def __init__(self, num_items=9, max_len=6, hidden=8, heads=2, n_layers=2):
        super().__init__()
        self.token = nn.Embedding(num_items + 2, hidden, padding_idx=0)  # (+ the mask token)
        self.pe = nn.Embedding(max_len, hidden)
        self.transformer_blocks = nn.ModuleList(
            BERT4RecBlock(hidden, heads) for _ in range(n_layers)
        )
        self.out = nn.Linear(hidden, num_items + 1)

    def forward(self, x):
        mask = (x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)
        x = self.token(x) + self.pe.weight.unsqueeze(0).repeat(x.size(0), 1, 1)
        for transformer in self.transformer_blocks:
            x = transformer(x, mask)
        return self.out(x)


def masked_items_cross_entropy(logits, labels):
    """BERT4Rec's ``CrossEntropyLoss(ignore_index=0)``, each sequence's own sum."""
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=0, reduction="none").sum(1)


def bert4rec():
    seqs = torch.tensor(
        [[0, 0, 3, 10, 5, 10], [2, 7, 10, 1, 4, 6], [0, 0, 0, 8, 10, 2]]
    )  # (10: masked)
    labels = torch.where(seqs == 10, torch.randint(1, 10, seqs.shape), 0)
    return Spec(BERT4Rec(), (seqs,), masked_items_cross_entropy, (labels,))


class InteractingLayer(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/layers/interaction.py``: AutoInt's
    ``InteractingLayer``, the heads split off the last dimension and stacked in front of the
    batch (``[heads, batch, fields, dim]``), joined back by ``cat(split(result, 1))``;
    its softmax over dimension 1, as written there, is over the batch (``softmax_dim=-1``
    over the fields)."""

    def __init__(self, embedding_size, att_embedding_size=2, head_num=2, softmax_dim=1):
        super().__init__()
        self.att_embedding_size, self.softmax_dim = att_embedding_size, softmax_dim
        shape = (embedding_size, att_embedding_size * head_num)
        self.W_Query, self.W_key, self.W_Value, self.W_Res = (
            nn.Parameter(0.05 * torch.randn(shape)) for _ in range(4)
        )

    def forward(self, inputs):
        querys = torch.tensordot(inputs, self.W_Query, dims=([-1], [0]))
        keys = torch.tensordot(inputs, self.W_key, dims=([-1], [0]))
        values = torch.tensordot(inputs, self.W_Value, dims=([-1], [0]))
        querys = torch.stack(torch.split(querys, self.att_embedding_size, dim=2))
        keys = torch.stack(torch.split(keys, self.att_embedding_size, dim=2))
        values = torch.stack(torch.split(values, self.att_embedding_size, dim=2))
        inner_product = torch.einsum("bnik,bnjk->bnij", querys, keys)
        scores = F.softmax(inner_product, dim=self.softmax_dim)
        result = torch.squeeze(
            torch.cat(torch.split(torch.matmul(scores, values), 1), dim=-1), dim=0
        )
        result = result + torch.tensordot(inputs, self.W_Res, dims=([-1], [0]))
        return F.relu(result)


class AutoInt(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/models/autoint.py``: ``AutoInt``, sparse
    features' embeddings stacked as fields, two interacting layers, the result flattened beside
    a DNN of the same embeddings, a sigmoid of their logits."""

    def __init__(self, vocab=(5, 7, 4), emb=4, softmax_dim=1):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(v, emb) for v in vocab)
        self.int_layers = nn.ModuleList(
            InteractingLayer(emb, softmax_dim=softmax_dim) for _ in range(2)
        )
        self.dnn = nn.Sequential(nn.Linear(len(vocab) * emb, 8), nn.ReLU())
        self.dnn_linear = nn.Linear(len(vocab) * emb + 8, 1, bias=False)

    def forward(self, X):  # noqa: N803
        att_input = torch.stack([e(X[:, i]) for i, e in enumerate(self.embeddings)], dim=1)
        dnn_output = self.dnn(att_input.flatten(1))
        for layer in self.int_layers:
            att_input = layer(att_input)
        return torch.sigmoid(self.dnn_linear(torch.cat([att_input.flatten(1), dnn_output], dim=-1)))


def bce(p, y):
    return F.binary_cross_entropy(p.squeeze(-1), y, reduction="none")


def click_batch(vocab=(5, 7, 4)):
    return torch.stack([torch.randint(v, (B,)) for v in vocab], 1), torch.randint(2, (B,)).float()


def autoint(softmax_dim):
    X, y = click_batch()
    return Spec(AutoInt(softmax_dim=softmax_dim), (X,), bce, (y,))


class Dice(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/layers/activation.py``: ``Dice``, a gate by
    the sigmoid of a BatchNorm1d of the input."""

    def __init__(self, emb_size):
        super().__init__()
        self.bn, self.alpha = (
            nn.BatchNorm1d(emb_size, eps=1e-8),
            nn.Parameter(torch.zeros(emb_size)),
        )

    def forward(self, x):  # [batch, T, emb]
        x = torch.transpose(x, 1, 2)
        x_p = torch.sigmoid(self.bn(x))
        return torch.transpose(self.alpha.unsqueeze(-1) * (1 - x_p) * x + x_p * x, 1, 2)


class LocalActivationUnit(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/layers/core.py``: ``LocalActivationUnit``,
    the candidate expanded over the history, ``[q, k, q - k, q * k]`` through a DNN."""

    def __init__(self, emb, hidden=8, activation="dice"):
        super().__init__()
        self.fc = nn.Linear(4 * emb, hidden)
        self.act = Dice(hidden) if activation == "dice" else nn.Sigmoid()
        self.dense = nn.Linear(hidden, 1)

    def forward(self, query, user_behavior):
        queries = query.expand(-1, user_behavior.size(1), -1)
        attention_input = torch.cat(
            [queries, user_behavior, queries - user_behavior, queries * user_behavior], dim=-1
        )
        return self.dense(self.act(self.fc(attention_input)))


class AttentionSequencePoolingLayer(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/layers/sequence.py``:
    ``AttentionSequencePoolingLayer``, the mask of each history's length from
    ``arange(max_length).repeat(batch_size, 1) < keys_length``, the scores of padding replaced
    by ``torch.where``, the history summed by them."""

    def __init__(self, emb, activation):
        super().__init__()
        self.local_att = LocalActivationUnit(emb, activation=activation)

    def forward(self, query, keys, keys_length):
        batch_size, max_length, _ = keys.size()
        keys_masks = torch.arange(max_length, dtype=keys_length.dtype).repeat(batch_size, 1)
        keys_masks = (keys_masks < keys_length.view(-1, 1)).unsqueeze(1)
        outputs = torch.transpose(self.local_att(query, keys), 1, 2)
        outputs = torch.where(keys_masks, outputs, torch.zeros_like(outputs))
        return torch.matmul(outputs, keys)


class DIN(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/models/din.py``: ``DIN``, the candidate
    item's embedding attending over the user's history of items (one embedding table), the
    pooled history and the candidate into a DNN."""

    def __init__(self, items=9, emb=4, activation="dice"):
        super().__init__()
        self.item_emb = nn.Embedding(items, emb, padding_idx=0)
        self.attention = AttentionSequencePoolingLayer(emb, activation)
        self.dnn = nn.Sequential(nn.Linear(2 * emb, 8), nn.ReLU(), nn.Linear(8, 1, bias=False))

    def forward(self, item, history, length):
        query, keys = self.item_emb(item).unsqueeze(1), self.item_emb(history)
        pooled = self.attention(query, keys, length)
        return torch.sigmoid(self.dnn(torch.cat([query, pooled], dim=-1).squeeze(1)))


def din(activation):
    length = torch.tensor([3, 5, 1])
    history = torch.randint(1, 9, (B, 5)) * (torch.arange(5) < length[:, None])
    args = (torch.randint(1, 9, (B,)), history, length)
    return Spec(DIN(activation=activation), args, bce, (torch.randint(2, (B,)).float(),))


class BiEncoder(nn.Module):
    """facebookresearch/DPR, ``dpr/models/biencoder.py``: ``BiEncoder`` and its loss
    (``BiEncoderNllLoss``): every question scored against every passage of the batch
    (``q_vectors @ ctx_vectors.T``), its own passage the positive, the others in-batch
    negatives. The passages, the forward's second input, as long as the batch, are taken as
    shared by every question (as ``docs/guarantees.md`` says of such an input, where the
    examples would meet through it): each question's ``grad1`` is its own loss's gradient
    against the batch's passages as a bank, the passage encoder's included; the passages are
    no examples of their own (under DP, the questions alone are protected)."""

    def __init__(self, vocab=13, dim=6):
        super().__init__()
        self.question_model = nn.Sequential(nn.EmbeddingBag(vocab, dim), nn.Linear(dim, dim))
        self.ctx_model = nn.Sequential(nn.EmbeddingBag(vocab, dim), nn.Linear(dim, dim))

    def forward(self, questions, contexts):
        scores = torch.matmul(self.question_model(questions), self.ctx_model(contexts).T)
        return F.log_softmax(scores, dim=1)


def dpr():
    """Each question alone against every passage of the batch, its own the positive."""
    split = lambda args, i: (args[0][i : i + 1], args[1])  # noqa: E731
    args = (torch.randint(13, (B, 4)), torch.randint(13, (B, 5)))
    nll = lambda lp, positive: -lp.gather(1, positive[:, None]).squeeze(1)  # noqa: E731
    return Spec(BiEncoder(), args, nll, (torch.arange(B),), split=split)


# -- graphs in plain torch ----------------------------------------------------------------------


class SAGEConv(nn.Module):
    """pyg-team/pytorch_geometric, ``torch_geometric/nn/conv/sage_conv.py``: ``SAGEConv``'s
    mean aggregation, ``lin_l(mean of neighbours) + lin_r(x)``, over ``node_dim=-2`` of a batch of
    signals on one fixed graph (sensors, a mesh): the neighbours' rows taken by ``index_select``
    and summed into their targets by ``index_add_``, divided by the in-degree."""

    def __init__(self, cin, cout):
        super().__init__()
        self.lin_l, self.lin_r = nn.Linear(cin, cout), nn.Linear(cin, cout, bias=False)

    def forward(self, x, edge_index):
        src, dst = edge_index
        messages = x.index_select(-2, src)
        out = torch.zeros_like(messages[..., :1, :]).expand(*x.shape[:-1], x.shape[-1]).clone()
        out.index_add_(-2, dst, messages)
        deg = torch.zeros(x.shape[-2], dtype=x.dtype).index_add_(
            0, dst, torch.ones_like(dst, dtype=x.dtype)
        )
        return self.lin_l(out / deg.clamp(min=1).unsqueeze(-1)) + self.lin_r(x)


class GraphSAGE(nn.Module):
    """Two ``SAGEConv`` layers and a per-node regression head, as in PyG's
    ``examples/graph_sage_unsup.py`` and traffic models on a fixed graph."""

    def __init__(self, cin=3, hidden=6):
        super().__init__()
        self.conv1, self.conv2, self.head = (
            SAGEConv(cin, hidden),
            SAGEConv(hidden, hidden),
            nn.Linear(hidden, 1),
        )

    def forward(self, x, edge_index):
        x = F.relu(self.conv1(x, edge_index))
        return self.head(F.relu(self.conv2(x, edge_index))).squeeze(-1)


def graphsage():
    edge_index = torch.tensor([[0, 1, 1, 2, 3, 4, 4, 0], [1, 0, 2, 1, 4, 3, 0, 4]])
    split = lambda args, i: (args[0][i : i + 1], args[1])  # noqa: E731 (the graph is shared)
    return Spec(
        GraphSAGE(), (torch.randn(B, 5, 3), edge_index), mse, (torch.randn(B, 5),), split=split
    )


class GATConv(nn.Module):
    """pyg-team/pytorch_geometric, ``torch_geometric/nn/conv/gat_conv.py`` with
    ``torch_geometric/utils/softmax.py`` and ``utils/scatter.py``: ``GATConv`` over
    ``node_dim=-2`` of a batch of signals on one fixed graph (self-loops added), each edge's
    score from its source's and target's attention terms, softmaxed over each target's edges by
    ``scatter_reduce_(..., "amax", include_self=False)`` of the detached scores, ``exp`` and a
    scattered sum, the messages summed into their targets."""

    def __init__(self, cin, cout, heads=2):
        super().__init__()
        self.heads, self.cout = heads, cout
        self.lin = nn.Linear(cin, heads * cout, bias=False)
        self.att_src, self.att_dst = (
            nn.Parameter(0.3 * torch.randn(1, heads, cout)),
            nn.Parameter(0.3 * torch.randn(1, heads, cout)),
        )
        self.bias = nn.Parameter(torch.zeros(heads * cout))

    @staticmethod
    def scatter(src, index, dim_size, reduce):
        size = list(src.shape)
        size[1] = dim_size
        index = index.view(1, -1, *[1] * (src.dim() - 2)).expand_as(src)
        if reduce == "sum":
            return src.new_zeros(size).scatter_add_(1, index, src)
        return src.new_zeros(size).scatter_reduce_(1, index, src, reduce="amax", include_self=False)

    def forward(self, x, edge_index):
        N = x.shape[1]
        loops = torch.arange(N)
        src, dst = torch.cat([edge_index[0], loops]), torch.cat([edge_index[1], loops])
        h = self.lin(x).view(x.shape[0], N, self.heads, self.cout)
        alpha_src, alpha_dst = (h * self.att_src).sum(-1), (h * self.att_dst).sum(-1)
        alpha = F.leaky_relu(alpha_src.index_select(1, src) + alpha_dst.index_select(1, dst), 0.2)
        alpha_max = self.scatter(alpha.detach(), dst, N, "max")
        alpha = (alpha - alpha_max.index_select(1, dst)).exp()
        alpha = alpha / (self.scatter(alpha, dst, N, "sum") + 1e-16).index_select(1, dst)
        out = self.scatter(h.index_select(1, src) * alpha.unsqueeze(-1), dst, N, "sum")
        return out.reshape(x.shape[0], N, -1) + self.bias


class GAT(nn.Module):
    """Two ``GATConv`` layers and a per-node head, as PyG's ``examples/gat.py`` stacks them."""

    def __init__(self, cin=3, hidden=4):
        super().__init__()
        self.conv1, self.conv2, self.head = (
            GATConv(cin, hidden),
            GATConv(2 * hidden, hidden, heads=1),
            nn.Linear(hidden, 1),
        )

    def forward(self, x, edge_index):
        return self.head(self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)).squeeze(-1)


def gat_fixed_graph():
    spec = graphsage()
    spec.model = GAT()
    return spec


class LightGCN(nn.Module):
    """gusye1234/LightGCN-PyTorch, ``code/model.py``: ``LightGCN``, the users' and items'
    embedding tables propagated over the normalized interaction graph (``torch.sparse.mm``
    of the tables' weights, layers averaged), then the batch's users, positive and negative
    items looked up; the loss BPR's of each (user, positive, negative) triple."""

    def __init__(self, users=4, items=5, dim=4, n_layers=2):
        super().__init__()
        self.users, self.n_layers = users, n_layers
        self.embedding_user, self.embedding_item = (
            nn.Embedding(users, dim),
            nn.Embedding(items, dim),
        )
        r = (torch.rand(users, items) < 0.5).float()
        adj = torch.zeros(users + items, users + items)
        adj[:users, users:], adj[users:, :users] = r, r.T
        d = adj.sum(1).clamp(min=1).pow(-0.5)
        self.register_buffer("graph", (d[:, None] * adj * d[None, :]).to_sparse())

    def computer(self):
        emb = torch.cat([self.embedding_user.weight, self.embedding_item.weight])
        embs = [emb]
        for _ in range(self.n_layers):
            emb = torch.sparse.mm(self.graph.to(emb.dtype), emb)
            embs.append(emb)
        light_out = torch.mean(torch.stack(embs, dim=1), dim=1)
        return torch.split(light_out, [self.users, light_out.shape[0] - self.users])

    def forward(self, users, pos_items, neg_items):
        all_users, all_items = self.computer()
        u, pos, neg = all_users[users], all_items[pos_items], all_items[neg_items]
        return (u * pos).sum(-1) - (u * neg).sum(-1)


def lightgcn():
    args = (torch.tensor([0, 2, 3]), torch.tensor([1, 4, 0]), torch.tensor([3, 2, 2]))
    return Spec(LightGCN(), args, lambda diff: F.softplus(-diff))


# -- reinforcement learning ---------------------------------------------------------------------


def layer_init(layer, std=2**0.5, bias_const=0.0):
    """vwxyzjn/cleanrl, ``cleanrl/ppo.py``: orthogonal weights, constant biases."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class PPOAgent(nn.Module):
    """vwxyzjn/cleanrl, ``cleanrl/ppo.py`` (``Categorical(logits=...)``) and
    ``cleanrl/ppo_continuous_action.py`` (``Normal`` of a mean and of ``exp`` of
    ``actor_logstd.expand_as(action_mean)``, a parameter of the agent itself):
    ``Agent.get_action_and_value`` for the stored actions."""

    def __init__(self, obs=4, act=2, continuous=False):
        super().__init__()
        self.continuous = continuous
        self.critic = nn.Sequential(layer_init(nn.Linear(obs, 8)), nn.Tanh(), layer_init(nn.Linear(8, 8)), nn.Tanh(),
                                    layer_init(nn.Linear(8, 1), std=1.0))  # fmt: skip
        self.actor = nn.Sequential(layer_init(nn.Linear(obs, 8)), nn.Tanh(), layer_init(nn.Linear(8, 8)), nn.Tanh(),
                                   layer_init(nn.Linear(8, act), std=0.01))  # fmt: skip
        if continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, act))

    def forward(self, x, action):
        if self.continuous:
            action_mean = self.actor(x)
            probs = Normal(action_mean, torch.exp(self.actor_logstd.expand_as(action_mean)))
            return probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)
        probs = Categorical(logits=self.actor(x))
        return probs.log_prob(action), probs.entropy(), self.critic(x)


def ppo_losses(
    out, logprobs, advantages, returns, values, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5
):
    """vwxyzjn/cleanrl, ``cleanrl/ppo.py``: each example's clipped surrogate, clipped value loss
    and entropy bonus (its mini-batch's advantages normalized beforehand, as data)."""
    newlogprob, entropy, newvalue = out
    ratio = (newlogprob - logprobs).exp()
    pg_loss = torch.max(
        -advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    )
    newvalue = newvalue.view(-1)
    v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
    v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2)
    return pg_loss - ent_coef * entropy + vf_coef * v_loss


def ppo(continuous):
    obs = torch.randn(B, 4)
    action = torch.randn(B, 2) if continuous else torch.randint(2, (B,))
    adv = torch.randn(B)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logprobs = torch.tensor([-0.6, -0.8, -0.7]) * (2 if continuous else 1)
    targets = (logprobs, adv, torch.randn(B), torch.tensor([0.1, -0.2, 0.05]))
    return Spec(PPOAgent(continuous=continuous), (obs, action), ppo_losses, targets)


class GaussianPolicy(nn.Module):
    """pranz24/pytorch-soft-actor-critic, ``model.py``: ``GaussianPolicy.sample``, the log
    standard deviation clamped, a reparametrized draw squashed by tanh, its log-probability
    corrected by ``log(action_scale * (1 - y_t ** 2) + epsilon)``; the draw's noise given as an
    input (``Normal.rsample`` is ``mean + std * noise``), each example's own."""

    def __init__(self, num_inputs=4, num_actions=2, hidden_dim=8):
        super().__init__()
        self.linear1, self.linear2 = (
            nn.Linear(num_inputs, hidden_dim),
            nn.Linear(hidden_dim, hidden_dim),
        )
        self.mean_linear, self.log_std_linear = (
            nn.Linear(hidden_dim, num_actions),
            nn.Linear(hidden_dim, num_actions),
        )

    def forward(self, state, noise):
        x = F.relu(self.linear2(F.relu(self.linear1(state))))
        mean, log_std = self.mean_linear(x), torch.clamp(self.log_std_linear(x), min=-20, max=2)
        normal = Normal(mean, log_std.exp())
        x_t = mean + log_std.exp() * noise
        y_t = torch.tanh(x_t)
        log_prob = normal.log_prob(x_t) - torch.log(1.0 * (1 - y_t.pow(2)) + 1e-6)
        return y_t, log_prob.sum(1, keepdim=True)


class QNetwork(nn.Module):
    """pranz24/pytorch-soft-actor-critic, ``model.py``: ``QNetwork``, twin Q heads of the
    state and action concatenated."""

    def __init__(self, num_inputs=4, num_actions=2, hidden_dim=8):
        super().__init__()
        self.q1 = nn.Sequential(
            nn.Linear(num_inputs + num_actions, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 1)
        )
        self.q2 = nn.Sequential(
            nn.Linear(num_inputs + num_actions, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 1)
        )

    def forward(self, state, action):
        xu = torch.cat([state, action], 1)
        return self.q1(xu), self.q2(xu)


class SAC(nn.Module):
    """pranz24/pytorch-soft-actor-critic, ``sac.py``: ``update_parameters``' policy loss,
    ``alpha * log_pi - min(Q1, Q2)`` of the policy's own action, and the critic's loss of the
    stored action against its target, in one backward."""

    def __init__(self, alpha=0.2, automatic_entropy_tuning=False, num_actions=2):
        super().__init__()
        self.alpha, self.policy, self.critic = alpha, GaussianPolicy(), QNetwork()
        self.automatic_entropy_tuning = automatic_entropy_tuning
        if automatic_entropy_tuning:  # (its own parameter, outside any layer)
            self.target_entropy = -float(num_actions)
            self.log_alpha = nn.Parameter(torch.zeros(1))

    def forward(self, state, noise, action):
        pi, log_pi = self.policy(state, noise)
        qf1_pi, qf2_pi = self.critic(state, pi)
        alpha = self.log_alpha.exp().detach() if self.automatic_entropy_tuning else self.alpha
        policy_loss = alpha * log_pi - torch.min(qf1_pi, qf2_pi)
        if self.automatic_entropy_tuning:
            policy_loss = policy_loss - self.log_alpha * (log_pi + self.target_entropy).detach()
        return policy_loss, self.critic(state, action)


def sac_losses(out, next_q_value):
    policy_loss, (qf1, qf2) = out
    return (policy_loss + (qf1 - next_q_value) ** 2 + (qf2 - next_q_value) ** 2).squeeze(1)


def sac(automatic_entropy_tuning=False):
    args = (torch.randn(B, 4), torch.randn(B, 2), torch.rand(B, 2) * 2 - 1)
    return Spec(
        SAC(automatic_entropy_tuning=automatic_entropy_tuning),
        args,
        sac_losses,
        (torch.randn(B, 1),),
    )


# -- the checks ---------------------------------------------------------------------------------

MATCH = {
    "qwen3-moe": qwen3_moe,
    "gemma3": gemma3,
    "gpt2-kv-cache": gpt2_kv_cache,
    "mixtral": mixtral,
    "deepseek-v3": deepseek_v3,
    "swin": swin,
    "swin-v2": swin_v2,
    "poolformer": poolformer,
    "efficientnet-frozen-bn": efficientnet,
    "convmixer-frozen-bn": convmixer,
    "coatnet-frozen-bn": coatnet,
    "pointnet2-frozen-bn": pointnet2,
    "nhits": nhits,
    "informer-probsparse": informer,
    "deepar": deepar,
    "bert4rec": bert4rec,
    "autoint-softmax-over-fields": partial(autoint, -1),
    "din-sigmoid": partial(din, "sigmoid"),
    "dpr-passages-shared": dpr,
    "graphsage-fixed-graph": graphsage,
    "gat-fixed-graph": gat_fixed_graph,
    "lightgcn": lightgcn,
    "ppo-categorical": partial(ppo, False),
    "ppo-gaussian": partial(ppo, True),
    "sac": sac,
    "sac-entropy-tuning": partial(sac, True),
}

REFUSED = {
    "convmixer": (
        partial(convmixer, False),
        gradhooks.MixedExamplesError,
        ["'2' (BatchNorm2d)", "train mode", "convert_batch_norm"],
    ),
    "autoint": (
        partial(autoint, 1),
        gradhooks.MixedExamplesError,
        ["'int_layers.1' (InteractingLayer)", "(3, 3, 4)", "softmax in 'int_layers.0'"],
    ),
    "din-dice": (
        partial(din, "dice"),
        gradhooks.MixedExamplesError,
        ["'attention.local_att.act.bn' (BatchNorm1d)", "eval mode"],
    ),
}


@pytest.mark.parametrize("name", MATCH)
def test_model_matches_the_loop(name):
    assert_matches_loop(MATCH[name])


@pytest.mark.parametrize("name", REFUSED)
def test_model_refused(name):
    factory, error, says = REFUSED[name]
    assert_refused(factory, error, says)


def test_the_check_tells_a_wrong_grad1(monkeypatch):
    """Two examples' ``grad1`` of one parameter swapped: the comparison with the loop fails."""
    monkeypatch.setattr(gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    with pytest.raises(AssertionError):
        assert_matches_loop(swin)


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.BatchNotFoundError,
    reason=(
        "DeepSeek-V3's MLA writes the batch's keys and values into caches of max_batch_size "
        "rows (k_cache[:bsz, start:end] = k) and reads them back (k_cache[:bsz, :end]): where "
        "the caches have more rows than the batch, the rows written are taken for no layout "
        "the tracker can give the whole cache (its first bsz rows the examples, the rest no "
        "example's), so the batch is lost there and the layers after are refused by their "
        "sizes, naming them; with caches of the batch's size the model matches the loop. "
        "Following a buffer's leading rows as the examples would take a layout of rows that "
        "are partly no example's, which the tracker does not have."
    ),
)
def test_caches_longer_than_the_batch():
    """A false refusal: the caches' rows past the batch are never read, and the loop works."""
    assert_matches_loop(partial(deepseek_v3, 4))


TRAINED = {
    "qwen3-moe": (qwen3_moe, "grad1"),
    "gpt2-kv-cache": (gpt2_kv_cache, "dp"),
    "deepseek-v3": (deepseek_v3, "grad1"),
    "bert4rec": (bert4rec, "dp"),
    "swin": (swin, "grad1"),
    "poolformer": (poolformer, "dp"),
    "nhits": (nhits, "dp"),
    "gemma3": (gemma3, "grad1"),
    "din-sigmoid": (partial(din, "sigmoid"), "dp"),
    "graphsage-fixed-graph": (graphsage, "grad1"),
    "ppo-gaussian": (partial(ppo, True), "grad1"),
    "sac": (sac, "dp"),
}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # (nn.RMSNorm's)
@pytest.mark.parametrize("name", TRAINED)
def test_model_trained_under_bf16_autocast(name):
    factory, how = TRAINED[name]
    train_bf16(factory, how)

"""Real models as their authors wrote them: tiny configurations of Hugging Face transformers
(random weights, dropout 0, float64), a PEFT LoRA adapter, and a nanoGPT-style model, each
checked parameter by parameter against a per-example loop, with sum and mean losses, with and
without ``position_ids``, and with a sequence as long as the batch is large (where sizes cannot
tell the batch from the sequence)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

transformers = pytest.importorskip(
    "transformers", reason="real-model tests need transformers: pip install -e '.[test]'"
)

D = torch.float64
V = 40  # vocabulary


def _quiet():
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*performance drop.*")


_quiet()


# -- the oracle and the check -------------------------------------------------------------------


def loop_oracle(model, batch: dict, loss_fn, size: int) -> dict[str, torch.Tensor]:
    """Each example's gradient, one forward and backward of a batch of one at a time."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    with gradhooks.paused():
        for b in range(size):
            one = {k: v[b : b + 1] if _per_example(k, v, size) else v for k, v in batch.items()}
            grads = torch.autograd.grad(
                loss_fn(model, one), [p for _, p in params], allow_unused=True
            )
            rows.append(
                [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, params)]
            )
    return {n: torch.stack([r[i] for r in rows]) for i, (n, _) in enumerate(params)}


def _per_example(key, v, size):
    shared = key == "position_ids"  # one row for the whole batch
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size and not shared


def close(got, want, what):
    """float64, to 1e-6 of the largest entry: some models compute in float32 inside (Hugging
    Face's attention takes its softmax in float32), which a mean loss then rounds differently
    from the loop's sum; a wrong per-example gradient is off by its own size."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale + 1e-12,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


def check_model(model, batch: dict, loss_fn, size: int, reduction: str, **hook_kwargs):
    """grad1 of every trainable parameter equals the loop's, in float64; grad1 reduces to .grad."""
    torch.manual_seed(0)
    model = model.double().eval()
    want = loop_oracle(model, batch, loss_fn, size)
    model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(model, loss_reduction=reduction, **hook_kwargs):
        loss = loss_fn(model, batch)
        (loss / size if reduction == "mean" else loss).backward()
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert hasattr(p, "grad1"), f"{n}: no grad1"
        got = p.grad1
        close(got, want[n], n)
        close(got.sum(0) if reduction == "sum" else got.mean(0), p.grad, f"{n} .grad")
        checked += 1
    assert checked
    for p in model.parameters():
        if hasattr(p, "grad1"):
            del p.grad1


def lm_loss(model, batch):
    """Next-token cross-entropy summed over positions and examples (each example's own loss is
    its sum)."""
    kw = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kw).logits
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="sum"
    )


def cls_loss(model, batch):
    kw = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(model(**kw).logits, batch["labels"], reduction="sum")


def text(size, seq, *, positions=False, classes=None, decoder=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (size, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if classes:
        batch["labels"] = torch.randint(0, classes, (size,), generator=g)
    else:
        batch["labels"] = torch.randint(0, V, (size, seq), generator=g)
    if positions:  # as a user passes them: one row, broadcast over the batch
        batch["position_ids"] = torch.arange(seq)[None]
    if decoder:
        batch["decoder_input_ids"] = torch.randint(0, V, (size, seq), generator=g)
    return batch


SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
             vocab_size=V, max_position_embeddings=32)  # fmt: skip
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def gpt2():
    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=V, n_positions=32,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def bert_cls():
    return transformers.BertForSequenceClassification(
        transformers.BertConfig(**SMALL, **NO_DROPOUT, num_labels=3)
    )


def bert_mlm():  # lm_head bias under two names, decoder tied to the word embeddings
    return transformers.BertForMaskedLM(transformers.BertConfig(**SMALL, **NO_DROPOUT))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=1))


def t5():
    cfg = transformers.T5Config(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                vocab_size=V, dropout_rate=0.0, relative_attention_num_buckets=8)  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def bart():
    cfg = transformers.BartConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, vocab_size=V,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(cfg)


def distilbert():
    cfg = transformers.DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=24,
                                        vocab_size=V, max_position_embeddings=32, dropout=0.0,
                                        attention_dropout=0.0, num_labels=3)  # fmt: skip
    return transformers.DistilBertForSequenceClassification(cfg)


def albert():
    cfg = transformers.AlbertConfig(**SMALL, **NO_DROPOUT, embedding_size=8,
                                    classifier_dropout_prob=0.0, num_labels=3)  # fmt: skip
    return transformers.AlbertForSequenceClassification(cfg)


def roberta():
    return transformers.RobertaForSequenceClassification(
        transformers.RobertaConfig(**SMALL, **NO_DROPOUT, num_labels=3, pad_token_id=1)
    )


def deberta_v2():  # relative-position projections of a [1, 2k, H] table, a table read directly
    cfg = transformers.DebertaV2Config(**SMALL, **NO_DROPOUT, num_labels=3, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], max_relative_positions=8,
                                       position_buckets=4)  # fmt: skip
    return transformers.DebertaV2ForSequenceClassification(cfg)


def mixtral():  # experts routing each token: rows picked by index, put back by index_add_
    cfg = transformers.MixtralConfig(**SMALL, num_key_value_heads=1, num_local_experts=3,
                                     num_experts_per_tok=2)  # fmt: skip
    cfg._experts_implementation = "eager"  # (the default grouped_mm takes no float64 on CPU)
    return transformers.MixtralForCausalLM(cfg)


def qwen2_moe():  # experts and a gated shared expert
    cfg = transformers.Qwen2MoeConfig(**SMALL, num_key_value_heads=1, num_experts=3,
                                      num_experts_per_tok=2, moe_intermediate_size=12,
                                      shared_expert_intermediate_size=12)  # fmt: skip
    cfg._experts_implementation = "eager"
    return transformers.Qwen2MoeForCausalLM(cfg)


def mpnet():  # relative bias expanded to the batch, .contiguous(), added in place
    cfg = transformers.MPNetConfig(**SMALL, **NO_DROPOUT, num_labels=3)
    return transformers.MPNetForSequenceClassification(cfg)


def tapas():  # token-type lookups of default (all-zero) ids, each added in place
    cfg = transformers.TapasConfig(**SMALL, **NO_DROPOUT, num_labels=3)
    return transformers.TapasForSequenceClassification(cfg)


def xlnet():  # sequence-first attention (fallback), position table expanded to the batch
    cfg = transformers.XLNetConfig(d_model=16, n_layer=2, n_head=2, d_inner=24, vocab_size=V,
                                   dropout=0.0, num_labels=3)  # fmt: skip
    model = transformers.XLNetForSequenceClassification(cfg)
    for n, p in model.named_parameters():  # (used only with target_mapping or segment ids)
        if n.endswith(("mask_emb", "r_s_bias", "seg_embed")):
            p.requires_grad_(False)
    return model


def funnel():  # relative attention run by the fallback: a [T, T] mask, an expanded type matrix
    cfg = transformers.FunnelConfig(
        d_model=16, n_head=2, d_head=8, d_inner=24, block_sizes=[1, 1], vocab_size=V,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, num_labels=3,
    )  # fmt: skip
    model = transformers.FunnelForSequenceClassification(cfg)
    for layer in model.funnel.encoder.blocks.modules():  # (a key's bias: zero gradient by
        if hasattr(layer, "k_head"):  # symmetry, its rounding all that is left to compare)
            layer.k_head.bias.requires_grad_(False)
    return model


def llama4():  # rotary embedding through torch.polar, a shared expert
    cfg = transformers.Llama4TextConfig(
        **SMALL, num_key_value_heads=1, head_dim=8, intermediate_size_mlp=24,
        num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
    )  # fmt: skip
    return transformers.Llama4ForCausalLM(cfg)


HF = {
    # name: (model factory, loss, batch kwargs, takes position_ids)
    "gpt2": (gpt2, lm_loss, {}, True),
    "bert-classifier": (bert_cls, cls_loss, {"classes": 3}, True),
    "bert-masked-lm": (bert_mlm, lm_loss, {}, True),
    "llama": (llama, lm_loss, {}, True),
    "t5": (t5, lm_loss, {"decoder": True}, False),
    "bart": (bart, lm_loss, {"decoder": True}, False),
    "distilbert": (distilbert, cls_loss, {"classes": 3}, False),
    "albert": (albert, cls_loss, {"classes": 3}, True),
    "roberta": (roberta, cls_loss, {"classes": 3}, False),
    "deberta-v2": (deberta_v2, cls_loss, {"classes": 3}, False),
    "mixtral": (mixtral, lm_loss, {}, False),
    "qwen2-moe": (qwen2_moe, lm_loss, {}, False),
    "mpnet": (mpnet, cls_loss, {"classes": 3}, False),
    "tapas": (tapas, cls_loss, {"classes": 3}, False),
    "xlnet": (xlnet, cls_loss, {"classes": 3}, False),
    "llama4": (llama4, lm_loss, {}, True),
    "funnel": (funnel, cls_loss, {"classes": 3}, False),
}


def _cases():
    for name, (_, _, _, positions) in HF.items():
        for pos in (False, True) if positions else (False,):
            for size, seq in ((3, 5), (4, 4), (3, 3)) if name == "funnel" else ((3, 5), (4, 4)):
                for reduction in ("sum", "mean"):
                    yield pytest.param(name, pos, size, seq, reduction,
                                       id=f"{name}-{'position_ids' if pos else 'built'}-B{size}T{seq}-{reduction}")  # fmt: skip


@pytest.mark.parametrize(("name", "positions", "size", "seq", "reduction"), list(_cases()))
def test_hugging_face(name, positions, size, seq, reduction):
    factory, loss_fn, kw, _ = HF[name]
    torch.manual_seed(0)
    check_model(factory(), text(size, seq, positions=positions, **kw), loss_fn, size, reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_t5_encoder_is_verified(reduction):
    """T5's encoder in float64, whose attention softmax runs in float32 (``.float()``, then
    ``.type_as``), under a loss of its final RMS-normed states, whose gradient before the norm
    is mostly cancellation: the first backward's check judges by the float32 it ran in, and
    does not refuse; grad1 is the loop's. (Under a mean, the loop is of each example's term of
    the mean, times the batch: the model rounds its float32 backward at the scale of the
    output-gradient it is given, and a cancellation of terms 10⁵ times larger than the result
    shows that rounding at 10% of it.)"""
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                vocab_size=V, dropout_rate=0.0,
                                relative_attention_num_buckets=8)  # fmt: skip
    model = transformers.T5EncoderModel(cfg).double().eval()
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))
    scale = 3 if reduction == "mean" else 1

    def loss(m, b):
        return 0.5 * m(input_ids=b["input_ids"]).last_hidden_state.pow(2).sum() / scale

    want = {n: g * scale for n, g in loop_oracle(model, {"input_ids": ids}, loss, 3).items()}
    with gradhooks.add_hooks(model, loss_reduction=reduction, verify=True):
        loss(model, {"input_ids": ids}).backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], n)
        close(p.grad1.sum(0) / scale, p.grad, f"{n} .grad")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_hugging_face_classifier_pooling_end_of_sequence(kind, reduction):
    """Sequence classification by an encoder-decoder: the hidden state at each example's
    end-of-sequence token, picked with a boolean mask over the whole batch
    (``h[eos_mask, :].view(B, -1, H)``), as many per example."""
    torch.manual_seed(0)
    if kind == "bart":
        cfg = transformers.BartConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, vocab_size=V,
            max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, classifier_dropout=0.0, num_labels=3,
        )  # fmt: skip
        model = transformers.BartForSequenceClassification(cfg)
    else:
        cfg = transformers.T5Config(d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2,
                                    vocab_size=V, dropout_rate=0.0, classifier_dropout=0.0,
                                    relative_attention_num_buckets=8, num_labels=3,
                                    decoder_start_token_id=0)  # fmt: skip
        model = transformers.T5ForSequenceClassification(cfg)
    batch = text(3, 4, classes=3)
    batch["input_ids"][:, -1] = cfg.eos_token_id
    batch["input_ids"][:, :-1] = batch["input_ids"][:, :-1].clamp_min(3)
    check_model(model, batch, cls_loss, 3, reduction)


def test_hugging_face_internal_loss_with_labels():
    """The model computes its own loss from labels (a mean over tokens): loss_reduction="mean"."""
    torch.manual_seed(0)
    model = gpt2().double().eval()
    batch = text(3, 5)
    ids = batch["input_ids"]

    def loss(m, b):
        return m(input_ids=b["input_ids"], labels=b["input_ids"]).loss

    want = loop_oracle(model, {"input_ids": ids}, loss, 3)
    with gradhooks.add_hooks(model):
        loss(model, {"input_ids": ids}).backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], n)


@pytest.mark.parametrize("detached", [False, True], ids=["", "detached"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "reentrant"])
@pytest.mark.parametrize("name", ["gpt2", "bert-masked-lm", "llama"])
def test_hugging_face_gradient_checkpointing(name, reentrant, detached):
    """``model.gradient_checkpointing_enable()`` (non-reentrant by default): every layer's
    forward runs again, untracked, in the backward, and must save what it saved tracked
    (Llama's rotary tables multiply the batch inside the checkpoint). ``detached``: the
    threshold at 1, as on long sequences: a reentrant checkpoint's recomputation runs every
    Linear call detached, its .grad summed from grad1; under a non-reentrant one (saved-tensor
    hooks) no call runs detached, in the forward or in its recomputation."""
    factory, loss_fn, kw, _ = HF[name]
    torch.manual_seed(0)
    model = factory().double().eval()
    batch = text(3, 5, **kw)
    want = loop_oracle(model, batch, loss_fn, 3)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None
    )
    model.train()  # (checkpointing runs in training mode only; dropout is 0)
    threshold = 1 if detached else gradhooks.TUNING.sum_grad1_positions
    with gradhooks.tuned(sum_grad1_positions=threshold):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            loss_fn(model, batch).backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], n)
        close(p.grad, want[n].sum(0), f"{n} .grad")


def padded(size, seq, **kw):
    """Sequences of unequal lengths: the last positions of some masked out."""
    batch = text(size, seq, **kw)
    for b, pad in enumerate((2, 0, 1, 3)[:size]):
        if pad:
            batch["attention_mask"][b, -pad:] = 0
    return batch


def opt():
    cfg = transformers.OPTConfig(hidden_size=16, num_hidden_layers=2, ffn_dim=24,
                                 num_attention_heads=2, vocab_size=V, max_position_embeddings=32,
                                 word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                                 pad_token_id=1)  # fmt: skip
    return transformers.OPTForCausalLM(cfg)


def mobilebert():
    cfg = transformers.MobileBertConfig(
        hidden_size=16, embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        num_feedforward_networks=2, vocab_size=V, max_position_embeddings=32, **NO_DROPOUT,
        classifier_dropout=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.MobileBertForSequenceClassification(cfg)


def longt5():
    cfg = transformers.LongT5Config(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                    vocab_size=V, dropout_rate=0.0, local_radius=2,
                                    relative_attention_num_buckets=8,
                                    encoder_attention_type="local")  # fmt: skip
    return transformers.LongT5ForConditionalGeneration(cfg)


PADDED = {
    "opt": (opt, lm_loss, {}),
    "mobilebert": (mobilebert, cls_loss, {"classes": 3}),
    "longt5-local": (longt5, lm_loss, {"decoder": True}),
    "bert-classifier": (bert_cls, cls_loss, {"classes": 3}),
    "llama": (llama, lm_loss, {}),
}


@pytest.mark.parametrize("size,seq,reduction", [(3, 5, "sum"), (4, 4, "mean")])
@pytest.mark.parametrize("name", list(PADDED))
def test_hugging_face_padding(name, size, seq, reduction):
    """An attention mask with zeros: each example's gradient is that of its own length."""
    factory, loss_fn, kw = PADDED[name]
    torch.manual_seed(0)
    check_model(factory(), padded(size, seq, **kw), loss_fn, size, reduction)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_with_labels_only(name):
    """Only ``labels=``: the decoder's input is the labels shifted right, written into a new
    buffer by ``shifted[:, 1:] = labels[:, :-1]``, and the model's loss is a mean."""
    torch.manual_seed(0)
    model = HF[name][0]().double().eval()
    model.config.decoder_start_token_id = model.config.pad_token_id = 0
    batch = text(3, 5)

    def loss(m, b):
        return m(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                 labels=b["labels"]).loss  # fmt: skip

    want = loop_oracle(model, batch, loss, 3)
    with gradhooks.add_hooks(model):  # (loss_reduction="mean")
        loss(model, batch).backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], n)


def test_gpt2_lora_adapter():
    """GPT-2 with a PEFT LoRA adapter: only the adapter's weights are trainable."""
    peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj"],
                             fan_in_fan_out=True)  # fmt: skip
    model = peft.get_peft_model(gpt2(), config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for reduction in ("sum", "mean"):
        check_model(model, text(3, 5), lm_loss, 3, reduction)


class AttentionClassifier(nn.Module):
    """Token embeddings, one ``nn.MultiheadAttention`` and a linear head over the mean."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.emb(ids)
        return self.fc(self.attn(h, h, h, need_weights=False)[0].mean(1))


def test_multihead_attention_lora_adapter():
    """PEFT's LoRA on ``nn.MultiheadAttention`` puts the adapter's matrices inside the attention's
    module tree and merges them into its weights before the call. 40 tokens: the in-projection
    runs detached (above ``TUNING.sum_grad1_positions``), and the adapter's grad1 comes from
    where the merge uses it. Against the per-example loop, both reductions."""
    peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["attn"])
    model = peft.get_peft_model(AttentionClassifier(), config).double().eval()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # (lora_B starts at zero: move off it)
        for p in trainable.values():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, V, (3, 40))
    y = torch.tensor([0, 2, 1])
    for reduction in ("sum", "mean"):
        loss_fn = lambda out, t, r=reduction: F.cross_entropy(out, t, reduction=r)  # noqa: E731
        want = gradhooks.oracle.loop_grad(model, loss_fn, ids, y)
        model.zero_grad(set_to_none=True)
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            loss_fn(model(ids), y).backward()
        for n, p in trainable.items():
            close(p.grad1, want[n], f"{n} ({reduction})")


def xglm():
    cfg = transformers.XGLMConfig(vocab_size=V, d_model=16, num_layers=2, attention_heads=2,
                                  ffn_dim=24, max_position_embeddings=32, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)  # fmt: skip
    return transformers.XGLMForCausalLM(cfg)


@pytest.mark.parametrize(("size", "seq"), [(3, 5), (4, 4)])
def test_xglm(size, seq):
    """XGLM clamps its attention scores with ``torch.max(scores, 0-d tensor)``: elementwise, not
    a reduction over the batch. (Its clamp value is made in the default dtype: float64 here.)"""
    old = torch.get_default_dtype()
    torch.set_default_dtype(D)
    try:
        torch.manual_seed(0)
        model = xglm()
        for reduction in ("sum", "mean"):
            check_model(model, text(size, seq), lm_loss, size, reduction)
    finally:
        torch.set_default_dtype(old)


def test_llama_boft_adapter():
    """Llama with a PEFT BOFT adapter (orthogonal butterfly factors built from the adapter's
    parameters alone, cast with ``.to(x)`` like the batch, multiplied into it): every adapter
    parameter gets its per-example gradient, and a DP step clips each example's own norm."""
    peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (peft: no CUDA extension for its block-diagonal kernel)
        config = peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"],
                                 boft_dropout=0.0)  # fmt: skip
        model = peft.get_peft_model(llama(), config).double()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("boft_" in n for n in trainable)
    with torch.no_grad():  # (initialized to the identity rotation: move off it)
        for p in trainable.values():
            p.add_(0.1 * torch.randn_like(p))
    batch = text(3, 5)
    for reduction in ("sum", "mean"):
        check_model(model, batch, lm_loss, 3, reduction)
    want = loop_oracle(model, batch, lm_loss, 3)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(model) as h:
        logits = model(input_ids=batch["input_ids"]).logits
        losses = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)
        got = gradhooks.dp_sgd_step(h, losses, max_norm=1e6, noise_multiplier=0.0, reduction="sum")
    close(got, norms, "per-example norms")
    for n, p in trainable.items():
        close(p.grad, want[n].sum(0), f"{n}: clipped sum")


@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_gpt2_prefix_and_prompt_tuning(method):
    """PEFT prefix tuning (virtual keys and values concatenated in front of every layer's, by
    ``torch.cat`` of a list) and prompt tuning (virtual tokens in front of the embeddings)."""
    peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")
    torch.manual_seed(0)
    config = (peft.PrefixTuningConfig if method == "prefix" else peft.PromptTuningConfig)(
        task_type="CAUSAL_LM", num_virtual_tokens=3
    )
    model = peft.get_peft_model(gpt2(), config)

    def loss(m, batch):  # (the logits of the virtual tokens, where there are any, dropped)
        logits = m(input_ids=batch["input_ids"]).logits[:, -batch["labels"].shape[1] :]
        return F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), reduction="sum")

    for reduction in ("sum", "mean"):
        check_model(model, text(3, 5), loss, 3, reduction)


# -- nanoGPT as nanoGPT writes it -------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """The layout of nanoGPT's GPT: learned positions looked up with arange(t), a tied output
    layer (``wte.weight = lm_head.weight``), the loss inside when targets are given.
    ``functional_head``: the output layer as ``F.linear(x, self.transformer.wte.weight)`` in the
    model's own forward instead (a parameter used outside its module's call)."""

    def __init__(
        self, vocab=V, block_size=16, n_layer=2, n_head=2, n_embd=16, functional_head=False
    ):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))  # fmt: skip
        self.functional_head = functional_head
        if not functional_head:
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if self.functional_head:
            logits = F.linear(x, self.transformer.wte.weight)
        else:
            logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
        )


@pytest.mark.parametrize("functional_head", [False, True], ids=["tied-lm_head", "F.linear-head"])
@pytest.mark.parametrize("size,seq", [(3, 6), (5, 5)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_nanogpt(functional_head, size, seq, reduction):
    torch.manual_seed(0)
    model = NanoGPT(functional_head=functional_head)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (size, seq), generator=g)
    targets = torch.randint(0, V, (size, seq), generator=g)

    def loss(m, batch):
        logits = m(batch["idx"])
        return F.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1), reduction="sum")

    check_model(model, {"idx": idx, "targets": targets}, loss, size, reduction)


def test_nanogpt_loss_inside():
    """nanoGPT's own loss (the mean over the batch's tokens): loss_reduction="mean"."""
    torch.manual_seed(0)
    model = NanoGPT().double()
    idx, targets = torch.randint(0, V, (4, 4)), torch.randint(0, V, (4, 4))
    want = loop_oracle(
        model, {"idx": idx, "targets": targets}, lambda m, b: m(b["idx"], b["targets"])[1], 4
    )
    with gradhooks.add_hooks(model):
        model(idx, targets)[1].backward()
    for n, p in model.named_parameters():
        close(p.grad1, want[n], n)


# -- timm and torchvision, where they import ----------------------------------------------------


def _vision(module: str):
    try:
        return pytest.importorskip(module, reason=f"{module} is not installed")
    except Exception as e:  # noqa: BLE001 (a build whose C ops do not load with this torch)
        pytest.skip(f"{module} does not import with this torch build: {type(e).__name__}: {e}")


TIMM = {
    "vit": dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
    "swin": dict(
        model_name="swin_tiny_patch4_window7_224",
        img_size=32,
        patch_size=4,
        window_size=4,
        depths=(1, 1),
        num_heads=(2, 2),
        embed_dim=16,
    ),  # fmt: skip
    "swinv2": dict(
        model_name="swinv2_tiny_window8_256",
        img_size=32,
        patch_size=4,
        window_size=4,
        depths=(1, 1),
        num_heads=(2, 2),
        embed_dim=16,
    ),  # fmt: skip
    "convnext": dict(model_name="convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32)),
    "beit": dict(
        model_name="beit_base_patch16_224",
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=32,
        num_heads=4,
    ),  # fmt: skip
}


def image_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


@pytest.mark.parametrize("name", list(TIMM))
def test_timm(name):
    timm = _vision("timm")
    kw = dict(TIMM[name])
    model = timm.create_model(kw.pop("model_name"), num_classes=3, **kw)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(3, 3, 32, 32, generator=g, dtype=D), "y": torch.tensor([0, 2, 1])}
    check_model(model, batch, image_loss, 3, "mean")


@pytest.mark.parametrize("name", ["resnet18", "vit", "swin_t"])
def test_torchvision(name):
    models = _vision("torchvision.models")
    if name == "resnet18":
        model = models.resnet18(num_classes=3, norm_layer=lambda c: nn.GroupNorm(2, c))
        size = 32
    elif name == "vit":
        model = models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                         hidden_dim=16, mlp_dim=24, num_classes=3)  # fmt: skip
        size = 32
    else:
        model = models.swin_t(num_classes=3)
        size = 64
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(2, 3, size, size, generator=g, dtype=D), "y": torch.tensor([0, 2])}
    check_model(model, batch, image_loss, 2, "mean")

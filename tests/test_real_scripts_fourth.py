"""Published training scripts, a fourth set, rewritten small, each step checked against the
float64 per-example loop.

As in ``test_real_scripts.py`` and ``test_real_scripts_second.py``: each test follows one script
of a public repository (cited in its docstring: repository and path), its model and its loop as
written there (the script's collator, optimizer, scheduler, clipping, accumulation and
evaluation), at tiny sizes, on synthetic data, in float64 where the script allows. These are
Hugging Face's ``no_trainer`` examples whose loss is not a plain mean over examples (masked
language modelling over the masked tokens of the batch, token classification over the labelled
tokens, semantic segmentation over the labelled pixels, translation with beam search between
epochs, CTC in float32), PEFT's examples of
adapters that the other sets leave out (AdaLoRA with its orthogonality penalty and its rank
allocation, P-tuning's prompt encoder), and the llama-recipes fine-tuning loop. At every step
``grad1`` is compared with each example's own gradient at that step's parameters
(:func:`gradhooks.oracle.loop_grad`, whose loss is each example's share of the batch's loss
times the batch size where the script's loss divides by a count over the whole batch: the row
``add_hooks``' default ``loss_reduction="mean"`` gives), or, where the script draws random
numbers in its forward, autograd's derivative of each row of one forward of the whole batch
with the same draws; where the script cannot be hooked as written, the test checks that
gradhooks refuses with a typed error naming the module and leaves the model as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_grad1,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
)

D = torch.float64
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_untouched(model, before: dict, what: str) -> None:
    """No parameter holds a ``grad1`` or a ``.grad`` after a refusal, and every parameter is
    as it was."""
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), f"{what}: {n} kept a grad1"
        assert p.grad is None, f"{what}: {n} kept a .grad"
        assert torch.equal(p.detach(), before[n]), f"{what}: {n} changed"


def share_of_the_count(logits_of, labels: torch.Tensor, ignore_index: int = -100):
    """The loss ``loop_grad`` gives each example for a cross-entropy averaged over the batch's
    counted tokens (``labels != ignore_index``): that example's summed token losses over the
    batch's count, times the batch size (the row of ``loss_reduction="mean"``)."""
    count, n = (labels != ignore_index).sum(), labels.shape[0]

    def loss(out, target):
        logits = logits_of(out, target)
        if logits.dim() == 2:  # (tokens flattened: [batch * length, classes])
            target = target.flatten()
        summed = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
        return n * summed / count

    return loss


def rows_of_one_forward(model, forward, losses_of) -> dict[str, torch.Tensor]:
    """``{name: [batch, *shape]}``: autograd's gradient of each row ``losses_of(forward())[i]``
    of one forward of the whole batch, with capture paused (the caller reseeds whatever the
    forward draws, so that it draws the hooked forward's numbers)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gradhooks.paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.GradhooksWarning)  # (no forward captured)
        losses = losses_of(forward())
        rows = [
            torch.autograd.grad(losses[i], [p for _, p in named], retain_graph=True,
                                allow_unused=True)
            for i in range(losses.shape[0])
        ]  # fmt: skip
    return {
        n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        for k, (n, p) in enumerate(named)
    }


# -- huggingface/transformers examples/pytorch/language-modeling/run_mlm_no_trainer.py -------------


def _word_level_tokenizer(vocab_size: int):
    """A word-level fast tokenizer whose words are ``w5`` ... (ids 5 on), with BERT's special
    tokens 0-4: what the collator needs of a tokenizer (its mask and pad ids, its vocabulary
    size, which tokens are special)."""
    tokenizers = pytest.importorskip("tokenizers")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(special)} | {f"w{i}": i for i in range(5, vocab_size)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip


def test_run_mlm_no_trainer_bert_masked_tokens_of_the_batch_tied_decoder_accumulation():
    """huggingface/transformers ``examples/pytorch/language-modeling/run_mlm_no_trainer.py``:
    ``DataCollatorForLanguageModeling(tokenizer, mlm_probability=...)`` masks tokens of the
    padded batch (80% ``[MASK]``, 10% a random token, 10% kept; ``labels`` -100 elsewhere),
    ``outputs = model(**batch)``, ``loss = outputs.loss`` (the mean over the batch's masked
    tokens), ``accelerator.accumulate`` at two steps (the loss halved), AdamW over the script's
    no-decay groups, ``get_scheduler("linear")``, then the evaluation's perplexity under
    ``no_grad`` in eval mode. ``BertForMaskedLM``'s decoder is the word embeddings (tied): one
    parameter used by the lookup and by the output layer. An example with no masked token
    has a row of zeros where it is not looked up. grad1 after each update is the halved sum
    of the two micro-batches' rows, each that example's masked tokens over its micro-batch's
    count."""
    vocab = 24
    tokenizer = _word_level_tokenizer(vocab)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).to(D)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ], lr=1e-3)  # fmt: skip
    accumulation = 2
    lr_scheduler = transformers.get_scheduler(
        "linear", optimizer, num_warmup_steps=0, num_training_steps=2
    )
    g = torch.Generator().manual_seed(0)

    def features(n):  # tokenized lines of unequal lengths, [CLS] ... [SEP]
        return [
            {"input_ids": [2, *torch.randint(5, vocab, (int(k),), generator=g).tolist(), 3]}
            for k in torch.randint(3, 7, (n,), generator=g)
        ]

    torch.manual_seed(1)  # (the collator draws its masks from torch's generator)
    with gradhooks.add_hooks(model):
        model.train()
        want = None
        for step in range(2 * accumulation):
            batch = collator(features(3))
            outputs = model(**batch)
            (outputs.loss / accumulation).backward()
            labels = batch.pop("labels")
            own = loop_grad(
                model, share_of_the_count(lambda o, t: o.logits.flatten(0, 1), labels), batch,
                labels,
            )  # fmt: skip
            want = {n: w / accumulation + (0 if want is None else want[n]) for n, w in own.items()}
            if (step + 1) % accumulation == 0:
                assert_grad1(model, want, f"update {step // accumulation}")
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                want = None
        model.eval()
        with torch.no_grad():
            batch = collator(features(3))
            assert torch.isfinite(torch.exp(model(**batch).loss))


# -- huggingface/transformers examples/pytorch/semantic-segmentation/ --------------------------------


def _segformer():
    config = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0,
        semantic_loss_ignore_index=255,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.SegformerForSemanticSegmentation(config).to(D)


def test_run_semantic_segmentation_segformer_batch_norm_refused_then_group_norm_trains():
    """huggingface/transformers ``examples/pytorch/semantic-segmentation/
    run_semantic_segmentation_no_trainer.py`` on a tiny ``SegformerForSemanticSegmentation``
    (overlapping patch embeddings, attention over keys and values reduced by a strided
    convolution, a depth-wise convolution in each MLP): ``outputs = model(**batch)``,
    ``loss = outputs.loss`` (the logits upsampled to the labels' size, bilinear, cross-entropy
    with ``ignore_index=255``: the mean over the batch's labelled pixels), AdamW and a linear
    schedule. The decode head's ``BatchNorm2d`` in training mode mixes the examples: the first
    backward is refused naming it, the model left as it was. Once
    ``gradhooks.convert_batch_norm`` makes it a GroupNorm, grad1 at every step is each
    example's labelled pixels over the batch's count."""
    model = _segformer()
    g = torch.Generator().manual_seed(0)

    def batch():
        pixels = torch.randn(3, 3, 16, 16, generator=g, dtype=D)
        labels = torch.randint(0, 3, (3, 16, 16), generator=g)
        labels[0, :5] = 255  # (the dataset's "ignore" label: unlabelled pixels)
        return {"pixel_values": pixels, "labels": labels}

    before = snapshot(model)
    model.train()
    with gradhooks.add_hooks(model):
        b = batch()
        raised(gradhooks.errors.MixedExamplesError, "'decode_head.batch_norm' (BatchNorm2d)",
               lambda: model(**b).loss.backward())  # fmt: skip
    assert_untouched(model, before, "refused")

    gradhooks.convert_batch_norm(model)  # (before the optimizer: its parameters are new)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-5)
    lr_scheduler = transformers.get_scheduler("linear", optimizer, 0, 3)

    def upsampled(out, target):
        logits = F.interpolate(out.logits, size=target.shape[-2:], mode="bilinear",
                               align_corners=False)  # fmt: skip
        return logits

    with gradhooks.add_hooks(model):
        for step in range(3):
            b = batch()
            outputs = model(**b)
            outputs.loss.backward()
            labels = b.pop("labels")
            want = loop_grad(model, share_of_the_count(upsampled, labels, 255), b, labels)
            assert_grad1(model, want, f"step {step}")
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()


# -- huggingface/transformers examples/pytorch/speech-recognition/run_speech_recognition_ctc.py ----


def _wav2vec2_ctc(mask_time_prob: float):
    """A tiny ``Wav2Vec2ForCTC`` as the script configures it: ``feat_extract_norm="group"`` (a
    GroupNorm after the first convolution, wav2vec2-base's), the script's ``mask_time_prob``
    (SpecAugment: spans of time steps replaced by ``masked_spec_embed``, drawn by numpy in the
    forward), ``ctc_loss_reduction="mean"``, the pad token the blank, dropout and LayerDrop 0."""
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=48, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, feat_extract_norm="group",
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=mask_time_prob,
        mask_time_length=2, mask_feature_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).to(D)
    model.freeze_feature_encoder()  # (the script's --freeze_feature_encoder, on by default)
    return model


def test_run_speech_recognition_ctc_spec_augment_refused_then_trained_with_its_embedding_frozen():
    """huggingface/transformers ``examples/pytorch/speech-recognition/
    run_speech_recognition_ctc.py``: ``Wav2Vec2ForCTC`` with its feature encoder frozen,
    SpecAugment on (``mask_time_prob``), labels padded with -100 by
    ``DataCollatorCTCWithPadding``; the Trainer's step: the loss (CTC of the log-softmax
    taken in float32, each example's divided by its label length, then the mean),
    ``backward``, ``clip_grad_norm_(model.parameters(), 1.0)``, AdamW, a linear schedule with
    warmup. As written, ``masked_spec_embed`` is a trainable parameter of ``Wav2Vec2Model``
    itself, which no rule covers: the fallback recomputes that module one example at a time
    and cannot draw numpy's masks again, so the backward is refused naming it, the model left
    as it was. With ``masked_spec_embed`` frozen, SpecAugment still masks each example's own
    time steps, and grad1 at every step is autograd's derivative of each example's CTC loss
    through one forward with the same masks, within float32's precision (the loss's)."""
    np = pytest.importorskip("numpy")
    model = _wav2vec2_ctc(mask_time_prob=0.3)
    g = torch.Generator().manual_seed(0)

    def batch():
        audio = torch.randn(3, 200, generator=g, dtype=D)
        labels = torch.randint(1, 12, (3, 4), generator=g)
        labels[1, 3:] = -100  # (a shorter transcript, padded by the collator)
        return {"input_values": audio, "labels": labels}

    def ctc_rows(logits, labels):
        log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        lengths = (labels >= 0).sum(-1)
        steps = torch.full((labels.shape[0],), logits.shape[1], dtype=torch.long)
        losses = F.ctc_loss(log_probs, labels[labels >= 0], steps, lengths, blank=0,
                            reduction="none")  # fmt: skip
        return losses / lengths

    model.train()
    before = snapshot(model)
    with gradhooks.add_hooks(model):
        b = batch()
        np.random.seed(0)
        raised(gradhooks.errors.MixedExamplesError, "'wav2vec2' (Wav2Vec2Model)",
               lambda: model(**b).loss.backward())  # fmt: skip
    assert_untouched(model, before, "refused")

    model.wav2vec2.masked_spec_embed.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    lr_scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 1, 3)
    with gradhooks.add_hooks(model):
        for step in range(3):
            b = batch()
            np.random.seed(step)
            loss = model(**b).loss
            loss.backward()
            np.random.seed(step)
            want = rows_of_one_forward(
                model, lambda b=b: model(b["input_values"]).logits,
                lambda logits, b=b: ctc_rows(logits, b["labels"]),
            )  # fmt: skip
            assert_grad1(model, want, f"step {step}", frozen_clean=True, rtol=1e-5, atol=1e-7)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()


# -- huggingface/peft examples/conditional_generation/peft_adalora_seq2seq.py ----------------------


def _adalora_bart(orth_reg_weight: float):
    peft = pytest.importorskip("peft")
    config = transformers.BartConfig(
        vocab_size=30, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.BartForConditionalGeneration(config)
    adalora = peft.AdaLoraConfig(
        init_r=6, target_r=4, beta1=0.85, beta2=0.85, tinit=1, tfinal=1, deltaT=1,
        lora_alpha=32, lora_dropout=0.0, task_type=peft.TaskType.SEQ_2_SEQ_LM,
        inference_mode=False, total_step=5, orth_reg_weight=orth_reg_weight,
    )  # fmt: skip
    return peft.get_peft_model(base, adalora).to(D)


def test_peft_adalora_seq2seq_orthogonality_penalty_and_rank_allocation():
    """huggingface/peft ``examples/conditional_generation/peft_adalora_seq2seq.py``: a BART
    with AdaLoRA (``AdaLoraConfig(init_r=12, target_r=8, beta1=0.85, beta2=0.85, tinit,
    tfinal, deltaT, lora_alpha=32, ...)``, here smaller), ``outputs = model(**batch)``,
    ``loss.backward()``, ``optimizer.step()``, ``lr_scheduler.step()``,
    ``model.base_model.update_and_allocate(global_step)`` (the singular values below the
    budget's threshold masked to 0 in place, from ``p * p.grad`` sensitivities), then
    ``optimizer.zero_grad()``. In training mode AdaLoRA's forward adds
    ``orth_reg_weight * ||AAᵀ - I||`` over the adapters to ``outputs.loss``: a term of the
    parameters alone, no example's. As written, the first backward is refused (grad1 would not
    add up to ``.grad``) and the model is left as it was. With ``verify=False``, as the error
    says, grad1 holds each example's share of the token loss (the mean over the batch's
    labelled tokens) and ``.grad`` its mean plus the penalty's gradient, at every step, the
    rank allocation's masking between steps included."""
    model = _adalora_bart(orth_reg_weight=0.5)
    shift = transformers.models.bart.modeling_bart.shift_tokens_right
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(3, 30, (3, 6), generator=g)
        labels = torch.randint(3, 30, (3, 4), generator=g)
        labels[2, 3:] = -100  # (a shorter target, padded with -100 by the script's map)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    model.train()
    before = snapshot(model)
    with gradhooks.add_hooks(model):
        b = batch()
        raised(gradhooks.errors.CheckFailedError, ["lora_", "penalty added to the loss"],
               lambda: model(**b).loss.backward())  # fmt: skip
    assert_untouched(model, before, "refused")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, 5)
    masked = 0
    with gradhooks.add_hooks(model, verify=False):
        for global_step in range(5):
            b = batch()
            outputs = model(**b)
            loss = outputs.loss
            loss.backward()
            labels = b.pop("labels")
            b["decoder_input_ids"] = shift(labels, 1, 2)
            want = loop_grad(
                model, share_of_the_count(lambda o, t: o.logits.flatten(0, 1), labels), b, labels
            )
            assert_grad1(model, want, f"step {global_step}")
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            with gradhooks.paused():  # the penalty: the model's loss less the token loss
                out = model(**b, labels=labels)
                token = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
                penalty = torch.autograd.grad(out.loss - token, [p for _, p in named],
                                              allow_unused=True)  # fmt: skip
            for (n, p), pen in zip(named, penalty):
                pen = torch.zeros_like(p) if pen is None else pen
                torch.testing.assert_close(p.grad, p.grad1.mean(0) + pen, rtol=1e-7, atol=1e-9,
                                           msg=lambda m, n=n: f"{n}: {m}")  # fmt: skip
            optimizer.step()
            lr_scheduler.step()
            model.base_model.update_and_allocate(global_step)
            optimizer.zero_grad()
            masked = sum(int((p == 0).sum()) for n, p in named if "lora_E" in n)
    assert masked, "the rank allocation masked no singular value"


# -- huggingface/peft examples/sequence_classification/P_Tuning.ipynb ------------------------------


def test_peft_p_tuning_roberta_prompt_encoder_on_padded_batches_with_evaluation():
    """huggingface/peft ``examples/sequence_classification/P_Tuning.ipynb``: a RoBERTa
    sequence classifier with ``PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=20,
    encoder_hidden_size=128)`` (here 4 and 16): the prompt encoder's embedding and MLP compute
    the virtual tokens from their indices, the same for every example, and the classifier
    head is trained as ``modules_to_save``. Right-padded batches (``DataCollatorWithPadding``),
    AdamW at 1e-3, ``get_linear_schedule_with_warmup``, each epoch followed by an evaluation in
    eval mode under ``no_grad`` (argmax predictions). grad1 at every step against the loop."""
    peft = pytest.importorskip("peft")
    config = transformers.RobertaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=40, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.RobertaForSequenceClassification(config)
    peft_config = peft.PromptEncoderConfig(
        task_type="SEQ_CLS", num_virtual_tokens=4, encoder_hidden_size=16
    )
    model = peft.get_peft_model(base, peft_config).to(D)
    g = torch.Generator().manual_seed(0)

    def batch():  # right-padded with RoBERTa's pad id 1
        lengths = torch.randint(3, 7, (3,), generator=g)
        ids = torch.full((3, int(lengths.max())), 1)
        for i, k in enumerate(lengths.tolist()):
            ids[i, :k] = torch.randint(3, 40, (k,), generator=g)
        mask = (ids != 1).long()
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(2, (3,), generator=g)}  # fmt: skip

    epochs, steps = 2, 2
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-3)
    lr_scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(0.06 * epochs * steps) + 1,
        num_training_steps=epochs * steps,
    )  # fmt: skip
    with gradhooks.add_hooks(model):
        for epoch in range(epochs):
            model.train()
            for step in range(steps):
                b = batch()
                outputs = model(**b)
                loss = outputs.loss
                loss.backward()
                labels = b.pop("labels")
                want = loop_grad(model, lambda o, t: F.cross_entropy(o.logits, t), b, labels)
                assert_grad1(model, want, f"epoch {epoch} step {step}", frozen_clean=True)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            model.eval()
            for _ in range(2):
                b = batch()
                with torch.no_grad():
                    outputs = model(**b)
                assert outputs.logits.argmax(dim=-1).shape == (3,)


# -- meta-llama/llama-recipes src/llama_recipes/utils/train_utils.py's train ------------------------


def test_llama_recipes_lora_finetuning_accumulation_clipping_steplr_and_evaluation():
    """meta-llama/llama-recipes ``src/llama_recipes/finetuning.py`` with
    ``utils/train_utils.py``'s ``train``, non-FSDP, on a tiny ``LlamaForCausalLM`` with the
    recipe's LoRA (``r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]``, here r=4, its
    dropout 0) and the "padding" batching strategy (``DataCollatorForSeq2Seq``: each batch
    right-padded to its own longest sample, the prompt's and the padding's labels -100): per
    epoch ``model.train()``, ``loss = model(**batch).loss / gradient_accumulation_steps``,
    ``backward``, and every second step ``clip_grad_norm_(model.parameters(), 1.0)``,
    ``optimizer.step()``, ``optimizer.zero_grad()``; ``StepLR(step_size=1, gamma=0.85)`` at
    the epoch's end, then ``evaluation`` (eval mode, ``no_grad``, the perplexity). grad1 at
    each update is the halved sum of its two micro-batches' rows (each padded otherwise),
    each that example's answer tokens over its micro-batch's count, within float32's
    precision (Hugging Face's causal-LM loss casts the logits to float32)."""
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    peft_config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=4, lora_alpha=32, lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"], bias="none",
    )  # fmt: skip
    model = peft.get_peft_model(model, peft_config).to(D)
    g = torch.Generator().manual_seed(0)

    def batch():  # prompt then answer, right-padded with 0; labels -100 on prompt and padding
        samples = []
        for _ in range(3):
            prompt, answer = (int(k) for k in torch.randint(2, 5, (2,), generator=g))
            samples.append((torch.randint(3, 32, (prompt + answer,), generator=g), prompt))
        longest = max(len(ids) for ids, _ in samples)
        ids = torch.zeros(3, longest, dtype=torch.long)
        labels = torch.full((3, longest), -100)
        for i, (s, prompt) in enumerate(samples):
            ids[i, : len(s)] = s
            labels[i, prompt : len(s)] = s[prompt:]
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}

    gradient_accumulation_steps, epochs, steps = 2, 2, 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.85)

    def shifted(out, target):  # (the model's own shift: logits of positions 0.., labels 1..)
        return out.logits[:, :-1].flatten(0, 1)

    with gradhooks.add_hooks(model):
        for epoch in range(epochs):
            model.train()
            want = None
            for step in range(steps):
                b = batch()
                loss = model(**b).loss
                loss = loss / gradient_accumulation_steps
                loss.backward()
                labels = b.pop("labels")
                own = loop_grad(model, share_of_the_count(shifted, labels[:, 1:]), b, labels[:, 1:])
                want = {
                    n: w / gradient_accumulation_steps + (0 if want is None else want[n])
                    for n, w in own.items()
                }  # fmt: skip
                if (step + 1) % gradient_accumulation_steps == 0:
                    assert_grad1(model, want, f"epoch {epoch} step {step}", frozen_clean=True,
                                 rtol=1e-5, atol=1e-7)  # fmt: skip
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
                    want = None
            scheduler.step()
            model.eval()
            eval_loss = 0.0
            for _ in range(2):
                with torch.no_grad():
                    eval_loss += model(**batch()).loss.detach().float()
            assert torch.isfinite(torch.exp(eval_loss / 2))


# -- huggingface/transformers examples/pytorch/translation/run_translation_no_trainer.py -----------


def test_run_translation_no_trainer_marian_with_generation_between_epochs():
    """huggingface/transformers ``examples/pytorch/translation/run_translation_no_trainer.py``
    on a tiny ``MarianMTModel`` (sinusoidal positions, scaled embeddings shared by the encoder,
    the decoder and the output layer, the ``final_logits_bias`` buffer):
    ``DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)`` (labels
    padded with -100, ``decoder_input_ids`` from the model's
    ``prepare_decoder_input_ids_from_labels``), ``outputs = model(**batch)``, ``loss =
    outputs.loss`` (the mean over the batch's target tokens), AdamW over the no-decay groups,
    ``get_scheduler("linear")``; after each epoch ``model.eval()`` and
    ``model.generate(..., max_length, num_beams=2)`` (beam search with its key-value cache,
    under ``no_grad``) on the evaluation batches, the hooks on. grad1 at every step against
    the loop of each example's target tokens over the batch's count."""
    config = transformers.MarianConfig(
        vocab_size=30, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=29, eos_token_id=0, decoder_start_token_id=29, forced_eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).to(D)
    g = torch.Generator().manual_seed(0)

    def batch():  # sources and targets of unequal lengths ending in </s> (0), padded (29)
        def padded(lengths, pad):
            rows = torch.full((3, int(lengths.max()) + 1), pad)
            for i, k in enumerate(lengths.tolist()):
                rows[i, :k] = torch.randint(1, 29, (k,), generator=g)
                rows[i, k] = 0
            return rows

        ids = padded(torch.randint(3, 6, (3,), generator=g), 29)
        labels = padded(torch.randint(2, 5, (3,), generator=g), -100)
        return {
            "input_ids": ids, "attention_mask": (ids != 29).long(), "labels": labels,
            "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=labels),
        }  # fmt: skip

    no_decay = ["bias", "layer_norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ], lr=5e-3)  # fmt: skip
    lr_scheduler = transformers.get_scheduler("linear", optimizer, 0, 4)
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for step in range(2):
                b = batch()
                outputs = model(**b)
                loss = outputs.loss
                loss.backward()
                labels = b.pop("labels")
                want = loop_grad(
                    model, share_of_the_count(lambda o, t: o.logits.flatten(0, 1), labels), b,
                    labels,
                )  # fmt: skip
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            model.eval()
            b = batch()
            with torch.no_grad():
                generated = model.generate(
                    input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    max_length=8, num_beams=2,
                )  # fmt: skip
            assert generated.shape[0] == 3


# -- huggingface/transformers examples/pytorch/token-classification/run_ner_no_trainer.py ----------


def test_run_ner_no_trainer_distilbert_labels_on_first_subwords_only():
    """huggingface/transformers ``examples/pytorch/token-classification/run_ner_no_trainer.py``
    on a tiny ``DistilBertForTokenClassification``: ``tokenize_and_align_labels`` without
    ``--label_all_tokens`` (each word's first sub-token labelled, its other sub-tokens and the
    special tokens -100), ``DataCollatorForTokenClassification`` (padding, labels -100),
    ``outputs = model(**batch)``, ``loss = outputs.loss`` (the mean over the batch's labelled
    tokens), ``accelerator.backward(loss)``, AdamW over the no-decay groups, a linear schedule
    with warmup, then the evaluation's ``predictions = outputs.logits.argmax(dim=-1)`` in eval
    mode under ``no_grad``. grad1 at every step against the loop of each example's labelled
    tokens over the batch's count."""
    config = transformers.DistilBertConfig(
        vocab_size=30, dim=32, n_layers=1, n_heads=2, hidden_dim=48, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0, num_labels=5, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DistilBertForTokenClassification(config).to(D)
    g = torch.Generator().manual_seed(0)

    def batch():  # [CLS] words (1 or 2 sub-tokens each) [SEP], padded with 0
        rows, tags = [], []
        for _ in range(3):
            ids, labels = [1], [-100]
            for _ in range(int(torch.randint(2, 4, (1,), generator=g))):
                pieces = int(torch.randint(1, 3, (1,), generator=g))
                ids += torch.randint(3, 30, (pieces,), generator=g).tolist()
                labels += [int(torch.randint(5, (1,), generator=g))] + [-100] * (pieces - 1)
            rows.append([*ids, 2])
            tags.append([*labels, -100])
        longest = max(map(len, rows))
        ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (longest - len(t)) for t in tags])
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ], lr=5e-3)  # fmt: skip
    lr_scheduler = transformers.get_scheduler("linear", optimizer, 1, 3)
    with gradhooks.add_hooks(model):
        model.train()
        for step in range(3):
            b = batch()
            outputs = model(**b)
            loss = outputs.loss
            loss.backward()
            labels = b.pop("labels")
            want = loop_grad(
                model, share_of_the_count(lambda o, t: o.logits.flatten(0, 1), labels), b, labels
            )
            assert_grad1(model, want, f"step {step}")
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        b = batch()
        with torch.no_grad():
            outputs = model(**b)
        predictions = outputs.logits.argmax(dim=-1)
        assert predictions.shape == b["labels"].shape

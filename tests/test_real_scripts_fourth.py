"""Published training scripts, a fourth set, rewritten small, each step checked against the
float64 per-example loop.

As in ``test_real_scripts.py`` and ``test_real_scripts_second.py``: each test follows one script
of a public repository (cited in its docstring: repository and path), its model and its loop as
written there (the script's collator, optimizer, scheduler, clipping, accumulation and
evaluation), at tiny sizes, on synthetic data, in float64 where the script allows. These are
Hugging Face's ``no_trainer`` examples whose loss is not a plain mean over examples (masked
language modelling over the masked tokens of the batch, token classification over the labelled
tokens, semantic segmentation over the labelled pixels, CTC in float32), PEFT's examples of
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

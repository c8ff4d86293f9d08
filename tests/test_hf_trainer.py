"""``gradhooks.hf.DPTrainer``: Hugging Face's ``Trainer`` with DP-SGD, checked step by step
against a float64 per-example loop: each example's own mean token loss, its gradient clipped,
the clipped gradients summed, the noise, the division by the expected batch size, the
optimizer's update. Tiny GPT-2 and BERT models built from configurations (random weights, no
download), a PEFT LoRA adapter, gradient accumulation, the privacy accounting and budget, and
bfloat16 autocast on the CPU."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradhooks

transformers = pytest.importorskip(
    "transformers", reason="the Trainer tests need transformers: pip install -e '.[test]'"
)
pytest.importorskip("dp_accounting", reason="the Trainer logs ε: pip install -e '.[test]'")

from gradhooks.errors import PrivacyBudgetExceeded  # noqa: E402
from gradhooks.hf import DPArguments, DPTrainer, per_example_loss  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*performance drop.*")
# (a library's notice of its own deprecations: peft calls an API of transformers' that warns so)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")

D = torch.float64
V, T = 32, 10  # vocabulary, sequence length


# -- data and models --------------------------------------------------------------------------


class Recorded(torch.utils.data.Dataset):
    """Token sequences of unequal lengths (right-padded, label -100 on the padding), each
    ``__getitem__`` recorded (the data loader reads a batch ahead of the one trained on)."""

    def __init__(
        self, n: int, seed: int = 0, classes: int | None = None, translate: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T), generator=g)
        self.lengths = torch.randint(3, T + 1, (n,), generator=g)
        self.classes = None if classes is None else torch.randint(0, classes, (n,), generator=g)
        # (a target sequence other than the input, for an encoder-decoder model)
        self.targets = (self.ids * 3 + 1) % V if translate else self.ids
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def example(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(T) < self.lengths[i]).long()
        item = {"input_ids": self.ids[i], "attention_mask": mask}
        if self.classes is None:
            item["labels"] = self.targets[i].masked_fill(mask == 0, -100)
        else:
            item["labels"] = self.classes[i]
        return item

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.seen.append(int(i))
        return self.example(int(i))


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=V, n_positions=T, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(D)


def bert(seed: int = 0, classes: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=V, max_position_embeddings=T, num_labels=classes,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).to(D)


def targs(tmp_path, **kwargs) -> transformers.TrainingArguments:
    """Plain SGD at a constant rate (the update is ``-lr · p.grad``), no checkpoints, quiet."""
    base = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="no", seed=0,
    )  # fmt: skip
    base.update(kwargs)
    return transformers.TrainingArguments(str(tmp_path / "out"), **base)


class Recording(DPTrainer):
    """Records the input rows of every physical batch trained on."""

    def per_example_losses(self, model, inputs):
        self.rows = getattr(self, "rows", []) + [inputs["input_ids"].clone()]
        return super().per_example_losses(model, inputs)


def trained(model, args, data, dp, **kwargs):
    """The trainer after ``train()``, and the parameters before it (copies)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Recording(model, args, train_dataset=data, dp=dp, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the Trainer's notes on its arguments)
        trainer.train()
    return trainer, before


# -- the float64 reference --------------------------------------------------------------------


def own_loss(model, item: dict, kind: str) -> torch.Tensor:
    """One example's own loss, run alone: the mean over its own labelled tokens of the
    next-token cross-entropy (``"causal"``), its cross-entropy (``"class"``), or the model's
    own loss of a batch of one (``"seq2seq"``: the mean over its labelled target tokens)."""
    if kind == "seq2seq":
        return model(**{k: v[None] for k, v in item.items()}).loss
    inputs = {k: v[None] for k, v in item.items() if k != "labels"}
    logits = model(**inputs).logits[0]
    if kind == "class":
        return F.cross_entropy(logits, item["labels"])
    terms = [
        -torch.log_softmax(logits[t], -1)[item["labels"][t + 1]]
        for t in range(T - 1)
        if item["labels"][t + 1] != -100
    ]
    return torch.stack(terms).mean()


def reference_update(model, data, batch, clip, expected, lr, kind="causal"):
    """``-lr · Σ_i min(1, C/‖g_i‖) g_i / L`` for the trainable parameters, by a loop of
    autograd over the examples one at a time (float64), and the norms ``‖g_i‖``."""
    model = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in batch:
        grads = torch.autograd.grad(own_loss(model, data.example(i), kind), list(params.values()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(float(norm))
        factor = min(1.0, clip / float(norm))
        for n, g in zip(params, grads, strict=True):
            total[n] += factor * g
    return {n: -lr * s / expected for n, s in total.items()}, norms


def drawn(trainer: Recording, data: Recorded, steps: int = 1) -> list[int]:
    """The examples of the physical batches trained on, by their tokens."""
    found = []
    for rows in trainer.rows:
        for row in rows:
            (i,) = [i for i in range(len(data)) if torch.equal(data.ids[i], row)]
            found.append(i)
    if steps == 1:
        assert len(set(found)) == len(found)  # (no stand-in for an empty batch among them)
    return sorted(found)


def assert_update(model, before, want, what=""):
    got = {n: p.detach() - before[n] for n, p in model.named_parameters() if n in want}
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=1e-7, atol=1e-9 * scale,
                                   msg=lambda m, n=n: f"{what}{n}: {m}")  # fmt: skip


# -- one step against the loop ------------------------------------------------------------------


def test_a_causal_lm_step_is_the_clipped_sum_of_each_examples_own_mean_token_loss(tmp_path):
    model, data = gpt2(), Recorded(16)
    clip, lr, expected = 3.5, 0.5, 4  # (L = 2 per device × 2 accumulation steps)
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3)
    trainer, before = trained(model, targs(tmp_path), data, dp)
    batch = drawn(trainer, data)
    assert len(batch) >= 3  # (this seed's batch: several examples, both physical batches used)
    want, norms = reference_update(_initial(model, before), data, batch, clip, expected, lr)
    assert min(norms) < clip < max(norms)  # some examples clipped, some not
    assert_update(model, before, want)
    assert trainer.accountant.steps == 1


def test_a_layer_wise_clipped_step_clips_each_layer_of_each_example(tmp_path):
    """DPArguments(clipping_groups="layer"): each module's part of each example's gradient
    clipped to C/√K (K modules with trainable parameters), against the float64 loop; the
    update is not the flat one's."""
    model, data = gpt2(), Recorded(16)
    clip, lr, expected = 3.5, 0.5, 4
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3,
                     clipping_groups="layer")  # fmt: skip
    trainer, before = trained(model, targs(tmp_path), data, dp)
    batch = drawn(trainer, data)
    initial = _initial(model, before)
    params = {n: p for n, p in initial.named_parameters() if p.requires_grad}
    owners: dict[str, list[str]] = {}
    for n in params:
        owners.setdefault(n.rpartition(".")[0], []).append(n)
    bound = clip / math.sqrt(len(owners))
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    clipped = 0
    for i in batch:
        grads = torch.autograd.grad(
            own_loss(initial, data.example(i), "causal"), list(params.values())
        )
        by_name = dict(zip(params, grads, strict=True))
        for names in owners.values():
            norm = float(torch.sqrt(sum(by_name[n].pow(2).sum() for n in names)))
            clipped += norm > bound
            for n in names:
                want[n] -= lr * min(1.0, bound / norm) * by_name[n] / expected
    assert 0 < clipped < len(batch) * len(owners)  # some layers clipped, some not
    assert_update(model, before, want)
    flat, _ = reference_update(initial, data, batch, clip, expected, lr)
    assert max(float((flat[n] - want[n]).abs().max()) for n in want) > 1e-4


def test_the_batch_token_mean_would_weigh_an_example_by_the_others_lengths(tmp_path):
    """The loss of the check above is each example's own mean: Hugging Face's batch-token mean
    (an example's token sum over the batch's token count) gives another update here."""
    model, data = gpt2(), Recorded(16)
    batch = [0, 1, 2, 3]
    assert len({int(data.lengths[i]) for i in batch}) > 1
    ref = copy.deepcopy(model)
    items = [data.example(i) for i in batch]
    inputs = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    logits = ref(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    mine = per_example_loss(logits, inputs["labels"], shift=True)
    own = torch.stack([own_loss(ref, it, "causal") for it in items])
    torch.testing.assert_close(mine, own, rtol=1e-10, atol=0)
    hf = ref(**inputs).loss.to(D)  # the batch-token mean (Hugging Face takes it in float32)
    tokens = (inputs["labels"][:, 1:] != -100).sum(1).to(D)
    shares = mine * tokens / tokens.sum()  # each example's share of the batch-token mean
    torch.testing.assert_close(shares.sum(), hf, rtol=1e-6, atol=0)
    assert not torch.allclose(shares * len(batch), mine)  # weights set by the others' lengths


@pytest.mark.parametrize("method", [None, "ghost"], ids=["bookkeeping", "ghost"])
def test_a_sequence_classifier_step(tmp_path, method):
    model, data = bert(), Recorded(16, classes=3)
    backwards = []  # (ghost clipping runs two backwards per physical batch, book-keeping one)
    model.classifier.register_full_backward_hook(lambda *args: backwards.append(1))
    clip, lr = 0.5, 0.5
    dp = DPArguments(
        max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3, method=method
    )
    trainer, before = trained(model, targs(tmp_path), data, dp)
    assert len(backwards) == len(trainer.rows) * (2 if method == "ghost" else 1)
    batch = drawn(trainer, data)
    assert len(batch) >= 2
    want, norms = reference_update(_initial(model, before), data, batch, clip, 4, lr, "class")
    assert max(norms) > clip
    assert_update(model, before, want)


def test_an_encoder_decoder_step(tmp_path):
    """BART: the labels go into the forward (the decoder's inputs are built from them), the
    loss is each example's mean over its own labelled target tokens, not shifted again."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=T + 2, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).to(D)
    data = Recorded(16, translate=True)
    clip, lr = 2.4, 0.5
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3)
    trainer, before = trained(model, targs(tmp_path), data, dp)
    want, norms = reference_update(
        _initial(model, before), data, drawn(trainer, data), clip, 4, lr, "seq2seq"
    )
    assert min(norms) < clip < max(norms), norms
    assert_update(model, before, want)


def test_gradient_accumulation_is_one_step_of_the_same_examples(tmp_path):
    """2 physical batches of 2 (expected) and 1 of 4: the same Poisson draws, the same noise
    (added once per logical batch), the same parameters after 2 steps. The second run also
    evaluates after each step (a forward of the hooked model without gradients), which
    changes nothing."""
    results = []
    for bs, accumulate in ((2, 2), (4, 1)):
        model, data = gpt2(), Recorded(16)
        dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0,
                         noise_seed=5, sampling_seed=3)  # fmt: skip
        evaluate = {} if accumulate == 2 else {"eval_strategy": "steps", "eval_steps": 1}
        args = targs(tmp_path, per_device_train_batch_size=bs,
                     gradient_accumulation_steps=accumulate, max_steps=2, **evaluate)  # fmt: skip
        extra = {} if accumulate == 2 else {"eval_dataset": Recorded(8, seed=1)}
        trainer, _ = trained(model, args, data, dp, **extra)
        if evaluate:
            assert sum("eval_loss" in entry for entry in trainer.state.log_history) == 2
        results.append((dict(model.named_parameters()), drawn(trainer, data, steps=2)))
    (a, seen_a), (b, seen_b) = results
    assert seen_a == seen_b
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-10, atol=1e-12, msg=n)


def test_an_empty_physical_batch_adds_nothing(tmp_path):
    """L = 2 as 2 physical batches of 1: a logical batch of 1 example leaves one physical
    batch empty, run as a stand-in example whose loss counts for nothing."""
    n, seed = 20, _seed_with_batch_size(20, 2, size=1)
    model, data = gpt2(), Recorded(n)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=0.0, sampling_seed=seed)
    args = targs(tmp_path, per_device_train_batch_size=1)
    trainer, before = trained(model, args, data, dp)
    batch = gradhooks.PoissonSampler(n, 2, generator=torch.Generator().manual_seed(seed))
    (batch,) = [next(iter(batch))]
    assert len(batch) == 1
    assert [len(rows) for rows in trainer.rows] == [1, 1]  # the example, and the stand-in
    want, _ = reference_update(_initial(model, before), data, batch, 1.0, 2, 0.5)
    assert_update(model, before, want)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_lora_only_the_adapter_changes(tmp_path):
    peft = pytest.importorskip("peft", reason="the LoRA test needs peft")
    base, data = gpt2(), Recorded(16)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                              fan_in_fan_out=True, init_lora_weights=False),
    )  # fmt: skip
    model = model.to(D)
    clip, lr = 0.4, 0.5
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3)
    trainer, before = trained(model, targs(tmp_path), data, dp)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in model.named_parameters():
        if n not in trainable:
            assert torch.equal(p, before[n]), f"{n} is frozen and changed"
    want, norms = reference_update(_initial(model, before), data, drawn(trainer, data), clip, 4, lr)
    assert min(norms) < clip < max(norms), norms
    assert_update(model, before, want)


def test_the_noise_is_gaussian_with_std_sigma_c_over_l(tmp_path):
    """The same step with and without noise: the difference is ``-lr · σ·C·z / L`` with
    ``z`` standard normal over every trainable entry, drawn from ``noise_seed``."""
    sigma, clip, lr, expected = 2.0, 1.0, 0.5, 4
    after = []
    for noise, seed in ((0.0, 0), (sigma, 0), (sigma, 1)):
        model, data = gpt2(), Recorded(16)
        dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=noise,
                         noise_seed=7, sampling_seed=3)  # fmt: skip
        trained(model, targs(tmp_path, seed=seed), data, dp)
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    z = (after[1] - after[0]) * (-expected / (lr * sigma * clip))
    # (noise_seed decides the noise, not the Trainer's seed, which seeds torch's generator)
    torch.testing.assert_close(after[1], after[2], rtol=0, atol=0)
    n = z.numel()
    assert n > 5000
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)


# -- privacy accounting and budget --------------------------------------------------------------


def test_epsilon_is_logged_as_the_accountant_of_the_same_steps(tmp_path):
    model, data = gpt2(), Recorded(16)
    sigma, delta = 1.3, 1e-5
    dp = DPArguments(max_grad_norm=1.0, delta=delta, noise_multiplier=sigma, sampling_seed=0)
    args = targs(tmp_path, max_steps=3, logging_strategy="steps", logging_steps=1)
    trainer, _ = trained(model, args, data, dp)
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3
    acc = gradhooks.PrivacyAccountant()
    for k, eps in enumerate(logged, 1):
        acc.step(noise_multiplier=sigma, sample_rate=4 / 16)
        assert eps == pytest.approx(acc.epsilon(delta), rel=1e-12), f"step {k}"
    assert logged[0] < logged[1] < logged[2]
    assert "grad_norm" not in trainer.state.log_history[0]


def test_the_noise_is_calibrated_to_the_budget(tmp_path):
    model, data = gpt2(), Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, target_epsilon=4.0, sampling_seed=0)
    args = targs(tmp_path, max_steps=3)
    trainer, _ = trained(model, args, data, dp)
    eps = trainer.accountant.epsilon(1e-5)
    assert trainer.accountant.steps == 3
    assert 0.99 * 4.0 < eps <= 4.0
    assert trainer.accountant.history == [(trainer.noise_multiplier, 4 / 16, 3)]


def test_a_run_over_the_budget_is_refused_before_its_first_step(tmp_path):
    model, data = gpt2(), Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, target_epsilon=1.0, noise_multiplier=0.8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model, targs(tmp_path, max_steps=10), train_dataset=data, dp=dp)
    with pytest.raises(PrivacyBudgetExceeded, match=r"10 more steps .* steps fit"):
        trainer.train()
    assert trainer.accountant.steps == 0 and data.seen == []
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_a_second_run_past_the_budget_is_refused(tmp_path):
    """A calibrated run spends the budget; a second ``train()`` is refused before its first
    step: the steps taken count with those planned."""
    model, data = gpt2(), Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, target_epsilon=3.0, sampling_seed=0)
    trainer, _ = trained(model, targs(tmp_path, max_steps=2), data, dp)
    assert trainer.accountant.steps == 2
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PrivacyBudgetExceeded, match="over target_epsilon=3"):
        trainer.train()
    assert trainer.accountant.steps == 2
    for n, p in model.named_parameters():
        assert torch.equal(p, after[n])


# -- mixed precision ----------------------------------------------------------------------------


def test_bf16_autocast_against_the_float64_loop(tmp_path):
    """``bf16=True`` on the CPU: the forward under bfloat16 autocast, float32 parameters. The
    update against the float64 loop of the same weights, to 2e-2 of its largest entry (about
    5 units of bfloat16's 2⁻⁸ ≈ 4e-3): a tiny GPT-2's per-example gradients are within about
    5e-3 of float64 under bf16 autocast (docs/mixed-precision.md), and clipping and summing
    do not add to the relative error (measured here: 3.7e-3; float32 without autocast:
    3e-7); a wrong clipping factor or loss is off by far more."""
    model, data = gpt2().float(), Recorded(16)
    clip, lr = 3.5, 0.5
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=3)
    trainer, before = trained(model, targs(tmp_path, bf16=True), data, dp)
    assert trainer.args.bf16
    initial = _initial(copy.deepcopy(model).to(D), {n: v.to(D) for n, v in before.items()})
    want, norms = reference_update(initial, data, drawn(trainer, data), clip, 4, lr)
    assert min(norms) < clip < max(norms)
    scale = max(float(w.abs().max()) for w in want.values())
    worst = max(float((p.detach().to(D) - before[n].to(D) - want[n]).abs().max())
                for n, p in model.named_parameters())  # fmt: skip
    assert worst < 2e-2 * scale
    assert worst > 1e-6 * scale  # (the forward ran in bfloat16: not float32's error)


# -- refusals -----------------------------------------------------------------------------------


def test_refused_settings(tmp_path):
    model, data = gpt2(), Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        DPTrainer(model, targs(tmp_path, auto_find_batch_size=True), train_dataset=data, dp=dp)
    with pytest.raises(ValueError, match="compute_loss_func"):
        DPTrainer(model, targs(tmp_path), train_dataset=data, dp=dp,
                  compute_loss_func=lambda outputs, labels, **kw: outputs.loss)  # fmt: skip
    with pytest.raises(TypeError, match="DPArguments"):
        DPTrainer(model, targs(tmp_path), train_dataset=data, dp={"max_grad_norm": 1.0})

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (data.example(i) for i in range(len(data)))

        def __len__(self):
            return len(data)

    with pytest.raises(ValueError, match="map-style dataset"):
        DPTrainer(model, targs(tmp_path), train_dataset=Stream(), dp=dp).train()
    args = targs(tmp_path, per_device_train_batch_size=16)
    with pytest.raises(ValueError, match="exceeds the 16 examples"):
        DPTrainer(model, args, train_dataset=data, dp=dp).train()
    with pytest.raises(ValueError, match="target_epsilon .*noise_multiplier"):
        DPArguments(max_grad_norm=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="max_grad_norm"):
        DPArguments(max_grad_norm=0.0, delta=1e-5, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"max_grad_norm\[1\] = -1"):
        DPArguments(max_grad_norm=[1.0, -1.0], delta=1e-5, noise_multiplier=1.0,
                    clipping_groups="layer")  # fmt: skip
    with pytest.raises(ValueError, match="in no clipping group"):  # (at train: the model's)
        DPTrainer(model, targs(tmp_path), train_dataset=data, dp=DPArguments(
            max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0,
            clipping_groups=[["transformer.wte.weight"]])).train()  # fmt: skip
    with pytest.raises(ValueError, match="delta"):
        DPArguments(max_grad_norm=1.0, delta=1.0, noise_multiplier=1.0)


def test_refused_at_train_before_a_step(tmp_path):
    model, data = gpt2(), Recorded(16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    trainer = DPTrainer(model, targs(tmp_path), train_dataset=data, dp=dp)
    with pytest.raises(ValueError, match="resume_from_checkpoint=True, but .* holds no checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="trial"):
        trainer.train(trial={"learning_rate": 0.1})
    trainer = DPTrainer(model, targs(tmp_path), train_dataset=data, dp=dp,
                        per_example_loss=lambda outputs, labels: outputs.logits.mean())  # fmt: skip
    with pytest.raises(ValueError, match=r"shape \[\d\]"):
        trainer.train()
    assert trainer.accountant.steps == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises(ValueError, match="no gradhooks hooks"):
        gradhooks.hooks_of(model)  # (the hooks are gone)


def test_a_delta_not_below_one_over_the_dataset_warns(tmp_path):
    """δ = 0.1 for 16 examples: an (ε, δ) guarantee with δ >= 1/n is met by publishing one
    example in the clear. The run warns (``GradhooksWarning``) naming δ and the dataset's
    size, as ``make_private`` does; δ = 1e-5 does not."""
    for delta, warns in ((0.1, True), (1e-5, False)):
        dp = DPArguments(max_grad_norm=1.0, delta=delta, noise_multiplier=1.0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trained(gpt2(), targs(tmp_path), Recorded(16), dp)
        ours = [str(w.message) for w in seen if w.category is gradhooks.GradhooksWarning]
        assert any("DPTrainer: delta=0.1" in m and "1/16" in m for m in ours) == warns, ours


def test_the_callers_arguments_are_left_as_they_were(tmp_path):
    args = targs(tmp_path, max_grad_norm=1.0)
    dp = DPArguments(max_grad_norm=0.3, delta=1e-5, noise_multiplier=1.0)
    trainer = DPTrainer(gpt2(), args, train_dataset=Recorded(16), dp=dp)
    assert args.max_grad_norm == 1.0
    assert trainer.args.max_grad_norm == 0.0  # (the batch gradient is not clipped again)


def test_per_example_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, dtype=D, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 3:] = -100
    labels[2, 1:] = -100  # (after the shift: no labelled token, loss 0)
    got = per_example_loss(logits, labels, shift=True)
    for b in range(3):
        terms = [F.cross_entropy(logits[b, t], labels[b, t + 1]) for t in range(4)
                 if labels[b, t + 1] != -100]  # fmt: skip
        want = torch.stack(terms).mean() if terms else torch.zeros((), dtype=D)
        torch.testing.assert_close(got[b], want)
    classes = torch.randn(4, 3, dtype=D, generator=g)
    y = torch.tensor([0, 2, 1, 2])
    torch.testing.assert_close(
        per_example_loss(classes, y), F.cross_entropy(classes, y, reduction="none")
    )
    value = torch.randn(4, 1, dtype=D, generator=g)
    target = torch.randn(4, dtype=D, generator=g)
    torch.testing.assert_close(per_example_loss(value, target), (value[:, 0] - target) ** 2)
    tagged = per_example_loss(logits, labels)  # (token classification: no shift)
    for b in range(3):
        keep = labels[b] != -100
        want = F.cross_entropy(logits[b][keep], labels[b][keep])
        torch.testing.assert_close(tagged[b], want)
    multi = torch.randint(0, 2, (4, 3), generator=g).to(D)
    torch.testing.assert_close(
        per_example_loss(classes, multi),
        F.binary_cross_entropy_with_logits(classes, multi, reduction="none").mean(1),
    )
    smooth = per_example_loss(classes, y, label_smoothing=0.1)
    log_p = torch.log_softmax(classes, -1)
    want = 0.9 * -log_p[torch.arange(4), y] + 0.1 * -log_p.mean(1)  # (Hugging Face's smoother)
    torch.testing.assert_close(smooth, want)
    with pytest.raises(ValueError, match="same \\[batch, tokens\\]"):
        per_example_loss(logits, labels[:, :4])


# -- helpers --------------------------------------------------------------------------------


def _initial(model, before):
    """A copy of ``model`` with the parameters it had before training."""
    initial = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in initial.named_parameters():
            p.copy_(before[n])
    return initial


def _seed_with_batch_size(n: int, expected: float, size: int) -> int:
    """A sampling seed whose first Poisson batch holds ``size`` examples."""
    for seed in range(1000):
        g = torch.Generator().manual_seed(seed)
        first = next(iter(gradhooks.PoissonSampler(n, expected, generator=g)))
        if len(first) == size:
            return seed
    raise AssertionError("no such seed")


# -- checkpoints --------------------------------------------------------------------------------


def _saving(tmp_path, steps: int, **kwargs):
    return targs(tmp_path, max_steps=steps, save_strategy="steps", save_steps=2, **kwargs)


def test_a_resumed_run_counts_the_steps_before_and_continues_the_noise(tmp_path):
    """A run of 4 steps, checkpointed every 2, resumed from step 2 by a new trainer: ε is the
    accountant's of all 4 steps (as one run's), the calibrated σ is the checkpoint's, and the
    seeded noise and sampling generators continue from their checkpointed states instead of
    starting their sequences again (which would add the same noise twice)."""
    data = Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, target_epsilon=4.0, noise_seed=1,
                     sampling_seed=2)  # fmt: skip
    first, _ = trained(gpt2(), _saving(tmp_path, 4), data, dp)
    sigma = first.noise_multiplier
    assert first.accountant.history == [(sigma, 4 / 16, 4)]
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "dp_state.pt", weights_only=True)
    assert saved["accountant"]["history"] == [[sigma, 4 / 16, 2]]
    assert not torch.equal(saved["noise_generator"], torch.Generator().manual_seed(1).get_state())

    model = gpt2()
    resumed = Recording(model, _saving(tmp_path, 4), train_dataset=data, dp=dp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.noise_multiplier == sigma
    assert resumed.accountant.history == [(sigma, 4 / 16, 4)]  # (2 before, 2 after)
    assert resumed.accountant.epsilon(1e-5) == pytest.approx(first.accountant.epsilon(1e-5))
    # (steps 3 and 4 drew the noise the uninterrupted run drew there: the same state after)
    assert torch.equal(resumed._noise.get_state(), first._noise.get_state())
    assert len(resumed.rows) == 4  # (2 steps of 2 physical batches after the checkpoint)


def test_resuming_past_the_budget_or_with_other_settings_is_refused(tmp_path):
    """The budget is checked for the steps left after the checkpoint's; a checkpoint of
    other settings (another C, another batch), of a seeded run resumed unseeded, or one a
    plain Trainer wrote (no privacy state) is refused, before any step."""
    data = Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0, sampling_seed=2)
    first, _ = trained(gpt2(), _saving(tmp_path, 2), data, dp)
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    eps_two = first.accountant.epsilon(1e-5)
    model = gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def resume(dp, args, path=checkpoint):
        trainer = DPTrainer(model, args, train_dataset=data, dp=dp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer.train(resume_from_checkpoint=path)
        return trainer

    tight = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0, sampling_seed=2,
                        target_epsilon=eps_two * 1.01)  # fmt: skip
    with pytest.raises(PrivacyBudgetExceeded, match=r"after the 2 steps already taken"):
        resume(tight, _saving(tmp_path, 6))
    other = DPArguments(max_grad_norm=2.0, delta=1e-5, noise_multiplier=1.0, sampling_seed=2)
    with pytest.raises(ValueError, match="max_grad_norm=1.0, this run has 2.0"):
        resume(other, _saving(tmp_path, 4))
    with pytest.raises(ValueError, match="sample_rate=0.25, this run has 0.375"):
        resume(dp, _saving(tmp_path, 4, per_device_train_batch_size=3))
    unseeded = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="sampling_seed"):
        resume(unseeded, _saving(tmp_path, 4))
    (tmp_path / "out" / "checkpoint-2" / "dp_state.pt").unlink()
    with pytest.raises(ValueError, match="holds no privacy state"):
        resume(dp, _saving(tmp_path, 4))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


class BoundRecording(Recording):
    """Records the clipping bound in use at every physical batch."""

    def per_example_losses(self, model, inputs):
        self.bounds = getattr(self, "bounds", []) + [self._dp_optimizer.max_grad_norm]
        return super().per_example_losses(model, inputs)


def test_adaptive_clipping_moves_the_bound_and_resumes_with_it(tmp_path):
    """DPArguments(adaptive_clipping=...): the bound moves from max_grad_norm step after step,
    each checkpoint's optimizer state holds the bound then in use, and a run resumed from it
    clips its first step with that bound (not max_grad_norm again); a checkpoint of other
    adaptive settings is refused."""
    data = Recorded(16)
    adaptive = gradhooks.AdaptiveClipping(target_quantile=0.5, learning_rate=0.5, count_noise=2.0)
    dp = DPArguments(max_grad_norm=5.0, delta=1e-5, noise_multiplier=1.0, noise_seed=1,
                     sampling_seed=2, adaptive_clipping=adaptive)  # fmt: skip
    first = BoundRecording(gpt2(), _saving(tmp_path, 4), train_dataset=data, dp=dp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        first.train()
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    bound = saved["adaptive_clipping_bound"]
    assert bound in first.bounds and bound != 5.0
    assert len(set(first.bounds)) > 2, first.bounds

    resumed = BoundRecording(gpt2(), _saving(tmp_path, 4), train_dataset=data, dp=dp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.bounds[0] == bound
    assert resumed.accountant.history == [(1.0, 4 / 16, 4)]

    other = DPArguments(max_grad_norm=5.0, delta=1e-5, noise_multiplier=1.0, noise_seed=1,
                        sampling_seed=2, adaptive_clipping=gradhooks.AdaptiveClipping(
                            count_noise=2.0))  # fmt: skip
    refused = DPTrainer(gpt2(), _saving(tmp_path, 4), train_dataset=data, dp=other)
    with pytest.raises(ValueError, match="adaptive_clipping"):
        refused.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    with pytest.raises(TypeError, match="AdaptiveClipping"):
        DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0,
                    adaptive_clipping={"target_quantile": 0.5})  # fmt: skip


def test_a_run_resumed_inside_an_epoch_trains_on_the_uninterrupted_runs_batches(tmp_path):
    """Resumed from a checkpoint inside an epoch (and from one at an epoch's end), the Trainer
    skips the batches trained on by drawing the epoch again from where it started: every batch
    after the checkpoint is the uninterrupted run's, and so are the weights at the end (the
    noise continues too). (The epoch's start is kept, not the generator's state at the
    checkpoint, which a loader's workers may have drawn ahead of.)"""
    data = Recorded(16)
    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0, noise_seed=1,
                     sampling_seed=2)  # fmt: skip

    def args(out, steps):
        return targs(tmp_path / out, max_steps=steps, save_strategy="steps", save_steps=2)

    whole, _ = trained(gpt2(), args("whole", 6), data, dp)  # (4 steps an epoch: 2 in, 1 out)
    for checkpoint, done in (("checkpoint-2", 2), ("checkpoint-4", 4)):
        model = gpt2()
        first, _ = trained(model, args(checkpoint, done), data, dp)
        resumed = Recording(model, args(checkpoint, 6), train_dataset=data, dp=dp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            resumed.train(resume_from_checkpoint=str(tmp_path / checkpoint / "out" / checkpoint))
        after = 2 * (6 - done)  # (2 physical batches a step)
        for got, want in zip(resumed.rows, whole.rows[-after:], strict=True):
            assert torch.equal(got, want), checkpoint
        for (n, p), q in zip(model.named_parameters(), whole.model.parameters(), strict=True):
            assert torch.equal(p, q), (checkpoint, n)

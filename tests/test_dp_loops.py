"""DP-SGD training loops as differential-privacy researchers write them, several steps each:
Poisson batches of every size, virtual steps, checkpoints, fine-tuning of small Hugging Face
models, clipping bounds that change, mixed precision, and the mistakes that are made. At every
step ``p.grad``, with the noise drawn again from a generator of the same seed and taken off,
is the clipped sum of the float64 per-example loop's gradients over the expected batch size;
the accountant's ε is compared with Opacus' accountants on the same history."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad

D = torch.float64
C, SIGMA, E = 1.0, 0.7, 5.0  # clipping bound (among the examples' norms), σ, expected batch


def mlp(seed: int = 0, dtype: torch.dtype = D) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def data(n: int = 40, seed: int = 1, dtype: torch.dtype = D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=D).to(dtype), torch.randint(3, (n,), generator=g)


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def clipped(per: dict, bounds, groups=None, automatic=False) -> tuple[dict, torch.Tensor]:
    """``Σ_i f_i g_i`` per parameter of the loop's ``per`` (``{name: [batch, *shape]}``), ``f_i``
    each group's factor ``min(1, C_k/‖g_ik‖)`` (one group of every parameter by default), and
    the whole gradients' norms."""
    groups = groups or [list(per)]
    bounds = bounds if isinstance(bounds, list | tuple) else [bounds]
    out = {}
    for group, c in zip(groups, bounds, strict=True):
        norms = torch.cat([per[n].flatten(1) for n in group], 1).norm(dim=1)
        f = c / (norms + 0.01) if automatic else (c / norms).clamp(max=1.0)
        for n in group:
            out[n] = torch.einsum("b,b...->...", f, per[n])
    return out, torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)


def denoised(model, noise_gen, std, denom) -> dict:
    """Each trainable parameter's ``.grad · denom`` less the noise ``std · z``, ``z`` drawn
    from ``noise_gen`` parameter after parameter, as the step draws it."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            z = torch.randn(p.shape, generator=noise_gen, dtype=p.dtype)
            out[n] = p.grad * denom - std * z
    return out


def assert_grads(got: dict, want: dict, what: str, rtol=1e-9, atol=1e-11) -> None:
    assert got.keys() == want.keys(), what
    for n in want:
        torch.testing.assert_close(got[n], want[n].to(got[n].dtype), rtol=rtol, atol=atol,
                                   msg=f"{what}: {n}")  # fmt: skip


def opacus_rdp_epsilon(history, delta: float) -> float:
    accountants = pytest.importorskip("opacus.accountants")
    theirs = accountants.RDPAccountant()
    theirs.history = [tuple(h) for h in history]
    return theirs.get_epsilon(delta)


# -- Poisson batches ------------------------------------------------------------------------------


def test_poisson_batches_of_every_size_and_an_empty_one_over_the_expected_size():
    """``dp_sgd_step`` on batches drawn by ``PoissonSampler`` (their sizes change at every step)
    and on an empty batch: each ``.grad``, the noise taken off, is the loop's clipped sum over
    the expected size (an empty batch's is the noise alone), and the ε the accountant gives
    for the steps is Opacus' RDP accountant's of the same history, within the two series'
    difference (docs/dp-training.md)."""
    pytest.importorskip("dp_accounting")
    x, y = data(40)
    model, twin = mlp(), mlp()
    sampler = gradhooks.PoissonSampler(40, E, steps=5, generator=torch.Generator().manual_seed(2))
    batches = list(sampler)  # (uniform draws: the same on every processor, unlike randn's)
    batches.insert(2, [])  # a draw that picked no example
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    accountant = gradhooks.PrivacyAccountant()
    noise, again = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step, idx in enumerate(batches):
            norms = gradhooks.dp_sgd_step(
                h, losses(model, x[idx], y[idx]), max_norm=C, noise_multiplier=SIGMA,
                generator=noise, expected_batch_size=E,
            )  # fmt: skip
            accountant.step(noise_multiplier=SIGMA, sample_rate=sampler.sample_rate)
            want = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
            if idx:
                want, want_norms = clipped(loop_grad(twin, F.cross_entropy, x[idx], y[idx]), C)
                torch.testing.assert_close(norms, want_norms, msg=f"step {step}: norms")
            assert norms.shape == (len(idx),)
            assert_grads(denoised(model, again, SIGMA * C, E), want, f"step {step}")
            opt.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)  # (the twin follows the noisy trajectory)
    assert len({len(b) for b in batches}) > 2, "the batches should differ in size"
    assert accountant.steps == len(batches)
    eps = accountant.epsilon(1e-5)
    assert eps == pytest.approx(opacus_rdp_epsilon(accountant.history, 1e-5), rel=1e-3)


def test_virtual_steps_in_physical_batches_of_at_most_three_count_logical_steps_only():
    """Opacus' ``BatchMemoryManager`` written out: each Poisson batch split into physical
    batches of at most 3 examples (an empty one into one physical batch of 0 rows),
    ``DPOptimizer.backward`` on each, one ``step`` and ``zero_grad`` per logical batch. Each
    step's ``.grad`` is the loop's clipped sum of the whole logical batch, the weights are
    those of the same optimizer on the unsplit batches, and the accountant has one entry per
    logical batch."""
    x, y = data(40)
    model, whole = mlp(), mlp()
    sampler = gradhooks.PoissonSampler(40, 7.0, steps=4, generator=torch.Generator().manual_seed(3))
    batches = list(sampler) + [[]]
    accountant = gradhooks.PrivacyAccountant()

    def dp(m, h):
        return gradhooks.DPOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.4, momentum=0.9), h, max_grad_norm=C,
            noise_multiplier=0.0, expected_batch_size=7.0, sample_rate=sampler.sample_rate,
            accountant=accountant if m is model else None,
        )  # fmt: skip

    with gradhooks.add_hooks(model, quantities=("norms",)) as h, \
            gradhooks.add_hooks(whole, quantities=("grad1",)) as hw:  # fmt: skip
        opt, opt_whole = dp(model, h), dp(whole, hw)
        for step, idx in enumerate(batches):
            want, _ = clipped(loop_grad(copy.deepcopy(model), F.cross_entropy, x[idx], y[idx]), C)
            physical = [idx[i : i + 3] for i in range(0, len(idx), 3)] or [[]]
            for part in physical:
                opt.backward(losses(model, x[part], y[part]))
            assert opt.step()
            opt_whole.backward(losses(whole, x[idx], y[idx]))
            opt_whole.step()
            got = {n: p.grad * 7.0 for n, p in model.named_parameters()}
            if not idx:
                want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            assert_grads(got, want, f"step {step} ({len(physical)} physical batches)")
            opt.zero_grad()
            opt_whole.zero_grad()
            for p, q in zip(model.parameters(), whole.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert accountant.steps == len(batches)
    assert [tuple(h) for h in accountant.history] == [(0.0, sampler.sample_rate, len(batches))]


def test_accumulation_by_hand_with_clipped_sum_and_the_noise_drawn_once():
    """The hand-written form of a virtual step: ``gradhooks.clipped_sum`` per micro-batch,
    summed, the noise added once and the sum divided by the expected batch size, written into
    ``.grad`` for AdamW. Each step is the loop's clipped sum of the logical batch plus one
    draw of noise."""
    x, y = data(30)
    model, twin = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    noise, again = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step, sizes in enumerate([(4, 2), (3, 3, 1), (5,)]):
            start = 3 * step
            idx = list(range(start, start + sum(sizes)))
            total = None
            for k in range(len(sizes)):
                part = idx[sum(sizes[:k]) : sum(sizes[: k + 1])]
                got = gradhooks.clipped_sum(h, losses(model, x[part], y[part]), max_norm=C)
                total = got.sums if total is None else [a + b for a, b in zip(total, got.sums)]
            for p, s in zip(got.params, total, strict=True):
                z = torch.randn(p.shape, generator=noise, dtype=p.dtype)
                p.grad = (s + SIGMA * C * z) / E
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)
            want, _ = clipped(loop_grad(twin, F.cross_entropy, x[idx], y[idx]), C)
            assert_grads(denoised(model, again, SIGMA * C, E), want, f"step {step}")
            opt.step()
            opt.zero_grad()


# -- checkpoints ----------------------------------------------------------------------------------


def _run_by_hand(steps: int, stop_after: int | None = None, state: bytes | None = None):
    """A hand-wired private run: Poisson batches, DPOptimizer over AdamW with a warm-up
    schedule, the accountant, the noise's and the sampler's generators; saved after
    ``stop_after`` steps, or resumed from ``state``."""
    x, y = data(60)
    model = mlp()
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    sampler_gen = torch.Generator().manual_seed(5)
    noise_gen = torch.Generator().manual_seed(6)
    sampler = gradhooks.PoissonSampler(60, 8.0, steps=1, generator=sampler_gen)
    accountant = gradhooks.PrivacyAccountant()
    opt = gradhooks.DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.05), hooks,
        max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=8.0,
        sample_rate=sampler.sample_rate, accountant=accountant, generator=noise_gen,
    )  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))
    done = 0
    if state is not None:
        saved = torch.load(io.BytesIO(state), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        accountant.load_state_dict(saved["accountant"])
        sampler_gen.set_state(saved["sampler"])
        noise_gen.set_state(saved["noise"])
        done = saved["step"]
    for step in range(done, steps):
        (idx,) = list(sampler)
        opt.backward(losses(model, x[idx], y[idx]))
        opt.step()
        opt.zero_grad()
        schedule.step()
        if step + 1 == stop_after:
            buf = io.BytesIO()
            torch.save({
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "schedule": schedule.state_dict(), "accountant": accountant.state_dict(),
                "sampler": sampler_gen.get_state(), "noise": noise_gen.get_state(),
                "step": step + 1,
            }, buf)  # fmt: skip
            hooks.remove()
            return None, None, buf.getvalue()
    hooks.remove()
    return model, accountant, None


def test_a_run_checkpointed_and_resumed_mid_training_is_the_uninterrupted_run():
    """Model, optimizer, LR schedule, accountant and both generators saved after two of five
    steps and loaded into fresh objects: the resumed run ends with the uninterrupted run's
    weights, bit for bit, and its history."""
    whole, acc_whole, _ = _run_by_hand(5)
    _, _, state = _run_by_hand(5, stop_after=2)
    resumed, acc_resumed, _ = _run_by_hand(5, state=state)
    for (n, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert acc_resumed.history == acc_whole.history and acc_whole.steps == 5


def test_a_dp_optimizer_state_loaded_mid_logical_batch_drops_the_batch_so_far():
    """``load_state_dict`` between two physical batches of a logical batch (a resume into a
    live optimizer): the clipped sums held so far are dropped, so the step is of the
    physical batches after it alone, as its docstring says."""
    x, y = data(10)
    model, twin = mlp(), mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=C,
            noise_multiplier=0.0, expected_batch_size=E,
        )  # fmt: skip
        state = opt.state_dict()
        opt.backward(losses(model, x[:4], y[:4]))
        opt.load_state_dict(state)
        assert opt.examples == 0
        opt.backward(losses(model, x[4:], y[4:]))
        opt.step()
    want, _ = clipped(loop_grad(twin, F.cross_entropy, x[4:], y[4:]), C)
    assert_grads({n: p.grad * E for n, p in model.named_parameters()}, want, "after the load")


# -- clipping bounds that change ------------------------------------------------------------------


def test_per_layer_bounds_on_a_schedule_set_between_steps():
    """Opacus-style per-layer clipping whose bounds a schedule lowers at every step
    (``opt.max_grad_norm = [...]`` between steps), then a flat bound: each step clips every
    parameter to its bound of that step, and the noise is σ times that step's total bound."""
    x, y = data(30)
    model, twin = mlp(), mlp()
    names = [n for n, _ in model.named_parameters()]
    noise, again = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.2), h, max_grad_norm=[0.5, 0.3, 0.5, 0.3],
            noise_multiplier=SIGMA, expected_batch_size=E, generator=noise,
            clipping_groups="parameter",
        )  # fmt: skip
        for step in range(3):
            bounds = [c * 0.7**step for c in opt.max_grad_norm]
            opt.max_grad_norm = bounds
            idx = list(range(5 * step, 5 * step + 5))
            opt.backward(losses(model, x[idx], y[idx]))
            opt.step()
            want, _ = clipped(loop_grad(twin, F.cross_entropy, x[idx], y[idx]), bounds,
                              [[n] for n in names])  # fmt: skip
            std = SIGMA * math.sqrt(sum(c * c for c in bounds))
            assert_grads(denoised(model, again, std, E), want, f"step {step}")
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)


def test_a_bound_changed_between_the_physical_batches_of_a_logical_batch_is_refused():
    """A clipping schedule stepped per physical batch: the examples so far were clipped to the
    old bound, and the noise of the new one would not cover them (too little noise where the
    bound went down). Refused at the next backward and at the step, naming both bounds,
    changing nothing; the bound put back, the step goes on."""
    x, y = data(10)
    model, twin = mlp(), mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=C,
            noise_multiplier=SIGMA, expected_batch_size=E,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        opt.backward(losses(model, x[:4], y[:4]))
        opt.max_grad_norm = 0.1
        with pytest.raises(gradhooks.StateError, match=r"max_grad_norm changed from 1\.0 to 0\.1"):
            opt.step()
        with pytest.raises(gradhooks.StateError, match=r"max_grad_norm changed"):
            opt.backward(losses(model, x[4:], y[4:]))
        assert all(p.grad is None for p in model.parameters())
        assert opt.examples == 4
        opt.max_grad_norm = C
        opt.backward(losses(model, x[4:], y[4:]))
        opt.noise_multiplier = 0.0
        opt.step()
    want, _ = clipped(loop_grad(twin, F.cross_entropy, x, y), C)
    assert_grads({n: p.grad * E for n, p in model.named_parameters()}, want, "the step")


def _adaptive_reference(batches, x, y, adaptive, bound, sigma, expected, seed):
    """The bound before each step by the paper's update, with the gradient's noise and the
    count's drawn from a generator of the same seed in the step's order."""
    model = mlp()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    sigma_b = expected / 20
    sigma_g = (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5
    bounds = []
    for idx in batches:
        bounds.append(bound)
        want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        norms = torch.zeros(0, dtype=D)
        if idx:
            want, norms = clipped(loop_grad(model, F.cross_entropy, x[idx], y[idx]), bound)
        for n, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad = (want[n] + sigma_g * bound * z) / expected
        count = float((norms <= bound).sum()) + sigma_b * float(
            torch.randn((), generator=gen, dtype=torch.float64)
        )
        fraction = count / expected
        bound = min(max(bound * math.exp(-adaptive.learning_rate * (fraction - adaptive.target_quantile)),
                        adaptive.min_bound), adaptive.max_bound)  # fmt: skip
        opt.step()
    return bounds + [bound], list(model.parameters())


def test_adaptive_bound_over_poisson_batches_split_and_empty_follows_the_papers_update():
    """Adaptive clipping with Poisson batches split into physical batches of at most 4 and an
    empty logical batch: the bound before every step, and the weights, are the paper's update
    computed by hand from the float64 loop's norms and the same noise (the count over the
    expected batch size, the gradient's multiplier σ_g = (σ⁻² - (2σ_b)⁻²)^(-1/2))."""
    x, y = data(40)
    sampler = gradhooks.PoissonSampler(40, 8.0, steps=4, generator=torch.Generator().manual_seed(1))
    batches = list(sampler)
    batches.insert(1, [])
    adaptive = gradhooks.AdaptiveClipping(target_quantile=0.5, learning_rate=0.3)
    want_bounds, want_params = _adaptive_reference(batches, x, y, adaptive, 2.0, SIGMA, 8.0, 11)
    model = mlp()
    got_bounds = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.3), h, max_grad_norm=2.0,
            noise_multiplier=SIGMA, expected_batch_size=8.0, adaptive_clipping=adaptive,
            generator=torch.Generator().manual_seed(11),
        )  # fmt: skip
        for idx in batches:
            got_bounds.append(opt.max_grad_norm)
            for part in [idx[i : i + 4] for i in range(0, len(idx), 4)] or [[]]:
                opt.backward(losses(model, x[part], y[part]))
            opt.step()
            opt.zero_grad()
        got_bounds.append(opt.max_grad_norm)
    assert len(set(want_bounds)) > 2, "the bound should move"
    assert got_bounds == pytest.approx(want_bounds, rel=1e-12)
    for p, q in zip(model.parameters(), want_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# -- Hugging Face fine-tuning ----------------------------------------------------------------------


def _bert(num_labels=3):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=12, num_labels=num_labels,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).to(D)


def _padded(seed: int, n: int = 4, length: int = 6):
    """Token ids right-padded with 0 to ``length``, their attention mask, and labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (n,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = torch.randint(1, 40, (n, length), generator=g) * mask
    return ids, mask, torch.randint(3, (n,), generator=g)


def _classifier_loss(out, y):
    return F.cross_entropy(out.logits, y)


def _fine_tune(model, steps=2, method=None):
    """DP steps of a sequence classifier on padded batches, each step's ``.grad`` compared with
    the loop's clipped sum over the trainable parameters."""
    twin = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(steps):
            ids, mask, y = _padded(step)
            out = model(input_ids=ids, attention_mask=mask)
            gradhooks.dp_sgd_step(
                h, F.cross_entropy(out.logits, y, reduction="none"), max_norm=0.5,
                noise_multiplier=0.0, expected_batch_size=E, method=method,
            )  # fmt: skip
            want, _ = clipped(loop_grad(twin, _classifier_loss, (ids, mask), y), 0.5)
            got = {n: p.grad * E for n, p in model.named_parameters() if p.requires_grad}
            assert_grads(got, want, f"step {step}")
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)
    return model


@pytest.mark.parametrize(("method", "reentrant"), [("bookkeeping", True), ("ghost", False)])
def test_bert_classifier_on_padded_batches_with_the_embeddings_frozen(method, reentrant):
    """A BERT sequence classifier fine-tuned on right-padded batches with attention masks, its
    embeddings frozen, under Hugging Face's activation checkpointing (reentrant or not): the
    encoder's and the head's steps are the loop's."""
    model = _bert()
    model.bert.embeddings.requires_grad_(False)
    enable = getattr(model, "activation_checkpointing_enable", None)  # (transformers >= 5)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": reentrant})
    model.train()  # (checkpointing runs in training mode only; the dropouts are 0)
    _fine_tune(model, method=method)


def test_lora_adapter_and_the_saved_classifier_of_a_peft_sequence_classifier():
    """PEFT LoRA on the attention's query and value with ``task_type="SEQ_CLS"``, which trains a
    copy of the classifier (``modules_to_save``) beside the adapters: only those train, and
    each step is the loop's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, lora_dropout=0.0,
                             target_modules=["query", "value"])  # fmt: skip
    model = peft.get_peft_model(_bert(), config)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("classifier" in n for n in trainable)
    _fine_tune(model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


@pytest.mark.parametrize(("method", "groups"), [("ghost", None), ("bookkeeping", "layer")])
def test_gpt2_tied_output_with_ignored_label_positions_and_dp_optimizer(method, groups):
    """A tiny GPT-2 whose output layer is the token embedding, fine-tuned on padded batches
    whose padding labels are -100: each example's loss is the mean of its own tokens'
    losses (shifted, as the model shifts them), two physical batches per step; clipped
    whole, or layer by layer (the tied weight in the group of the embedding, its owner in
    ``named_parameters()``, each of the K groups to C/√K)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=30, n_positions=10, n_embd=12, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(D)
    assert model.lm_head.weight is model.transformer.wte.weight
    twin = copy.deepcopy(model)

    def token_losses(logits, labels):
        per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                    ignore_index=-100, reduction="none")  # fmt: skip
        return per_token.sum(1) / (labels[:, 1:] != -100).sum(1)

    def one(out, labels):
        return token_losses(out.logits, labels).sum()

    class Keywords(nn.Module):  # (the loop calls its model positionally)
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, mask):
            return self.lm(input_ids=ids, attention_mask=mask)

    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), h,
                                    max_grad_norm=0.5, noise_multiplier=0.0,
                                    expected_batch_size=4.0, method=method,
                                    clipping_groups=groups)  # fmt: skip
        for step in range(2):
            ids, mask, _ = _padded(10 + step)
            ids = ids % 30
            labels = ids.masked_fill(mask == 0, -100)
            for part in (slice(0, 3), slice(3, 4)):
                out = model(input_ids=ids[part], attention_mask=mask[part])
                opt.backward(token_losses(out.logits, labels[part]))
            opt.step()
            per = loop_grad(Keywords(twin), one, (ids, mask), labels)
            per = {n.removeprefix("lm."): g for n, g in per.items()}
            owners: dict[str, list[str]] = {}
            for n in per:
                owners.setdefault(n.rsplit(".", 1)[0] if groups else "", []).append(n)
            parts = list(owners.values())
            assert len(parts) == (9 if groups else 1)  # (wte with the head, wpe, 6 in h.0, ln_f)
            want, _ = clipped(per, [0.5 / math.sqrt(len(parts))] * len(parts), parts)
            got = {n: p.grad * 4.0 for n, p in model.named_parameters()}
            assert_grads(got, want, f"step {step}")
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)


# -- mixed precision, schedules, EMA -------------------------------------------------------------


def test_bf16_autocast_adamw_decay_after_the_noise_warmup_and_an_ema():
    """A float32 model under bfloat16 autocast, DPOptimizer over AdamW (its weight decay applied
    by AdamW after the noise, to the weights, not clipped), a linear warm-up and an EMA of the
    weights: each ``.grad`` is the float64 loop's within bfloat16's rounding, the weights are
    AdamW's step on that ``.grad``, and the EMA follows its formula."""
    x, y = data(30, dtype=torch.float32)
    model = mlp(dtype=torch.float32)
    ema = copy.deepcopy(model).requires_grad_(False)
    shadow = copy.deepcopy(model)  # AdamW on the same .grad, without DP
    shadow_opt = torch.optim.AdamW(shadow.parameters(), lr=0.05, weight_decay=0.2)
    noise, again = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.2), h,
            max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=E, generator=noise,
        )  # fmt: skip
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
        shadow_warmup = torch.optim.lr_scheduler.LinearLR(shadow_opt, start_factor=0.25,
                                                          total_iters=3)  # fmt: skip
        for step in range(4):
            idx = list(range(6 * step, 6 * step + 6))
            twin = copy.deepcopy(model).to(D)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                opt.backward(losses(model, x[idx], y[idx]))
            opt.step()
            want, _ = clipped(loop_grad(twin, F.cross_entropy, x[idx].to(D), y[idx]), C)
            # bfloat16 keeps 8 bits: each clipped gradient within 2^-7 of its norm, ≤ C
            got = denoised(model, again, SIGMA * C, E)
            for n in want:
                err = (got[n].to(D) - want[n]).norm()
                assert err <= 6 * 2**-7 * C, f"step {step}: {n} off by {err:.3g}"
            for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
                q.grad = p.grad.clone()
            shadow_opt.step()
            shadow_warmup.step()
            warmup.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
                    assert torch.equal(p, q)
                    q.copy_(p)
                before = [e.clone() for e in ema.parameters()]
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 0.1)
                for b, e, p in zip(before, ema.parameters(), model.parameters(), strict=True):
                    torch.testing.assert_close(e, 0.9 * b + 0.1 * p)
            opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_float16_grad_scaler_virtual_steps_skip_an_overflow_and_do_not_account_it():
    """float16 autocast with a ``GradScaler`` and two physical batches per logical batch, one
    example of the second step's batch Inf: that step is skipped (no noise, no update, not
    in the accountant) and the scale halved; the steps around it are the float64 loop's
    within float16's rounding, and the weights are SGD's on them."""
    x, y = data(30, dtype=torch.float32)
    model = mlp(dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    accountant = gradhooks.PrivacyAccountant()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.3), h, max_grad_norm=C,
            noise_multiplier=0.0, expected_batch_size=E, scaler=scaler, sample_rate=0.1,
            accountant=accountant,
        )  # fmt: skip
        for step in range(3):
            idx = list(range(6 * step, 6 * step + 6))
            xs = x[idx].clone()
            if step == 1:
                xs[4, 0] = float("inf")
            twin = copy.deepcopy(model).to(D)
            before = [p.detach().clone() for p in model.parameters()]
            scale = scaler.get_scale()
            for part in (slice(0, 3), slice(3, 6)):
                with torch.autocast("cpu", dtype=torch.float16):
                    opt.backward(losses(model, xs[part], y[idx][part]))
            stepped = opt.step()
            assert stepped == (step != 1)
            assert accountant.steps == (step + 1 if step == 0 else step)
            if not stepped:
                assert scaler.get_scale() == scale / 2
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            else:
                want, _ = clipped(loop_grad(twin, F.cross_entropy, xs.to(D), y[idx]), C)
                for (n, p), b in zip(model.named_parameters(), before, strict=True):
                    # each of the 6 clipped gradients (norm <= C) within 2^-9 of its norm
                    err = (p.grad.to(D) * E - want[n]).norm()
                    assert err <= 6 * 2**-9 * C, f"step {step}: {n} off by {err:.3g}"
                    torch.testing.assert_close(p, b - 0.3 * p.grad, rtol=0, atol=1e-7)
            opt.zero_grad()


# -- the accountant -------------------------------------------------------------------------------


def test_epsilon_of_a_run_whose_rate_and_noise_change_is_opacus_rdp_and_prv():
    """Two phases (the data set doubled, σ lowered), as a curriculum run records them: RDP is
    Opacus' RDP on the same history (gradhooks' bound the same or a little above), and PLD
    is Opacus' PRV within their discretisations (docs/privacy-accounting.md: 0.5%)."""
    pytest.importorskip("dp_accounting")
    accountants = pytest.importorskip("opacus.accountants")
    rdp, pld = gradhooks.PrivacyAccountant("rdp"), gradhooks.PrivacyAccountant("pld")
    for acc in (rdp, pld):
        acc.step(noise_multiplier=1.2, sample_rate=64 / 5000, steps=150)
        acc.step(noise_multiplier=0.9, sample_rate=64 / 10000, steps=300)
    theirs = opacus_rdp_epsilon(rdp.history, 1e-5)
    assert theirs <= rdp.epsilon(1e-5) <= theirs * (1 + 1e-3)
    prv = accountants.PRVAccountant()
    prv.history = [tuple(h) for h in pld.history]
    assert pld.epsilon(1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=0.01)


# -- make_private ---------------------------------------------------------------------------------


def test_make_private_with_frozen_embeddings_steps_on_each_logical_batch():
    """``make_private`` on a bag-of-words model whose embedding is frozen, with physical
    batches of at most 4: the physical batches gathered until ``step()`` says a logical batch
    ended are the ones each step clips, over the expected batch size."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(20, (48, 5), generator=g)
    labels = torch.randint(2, (48,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 6), nn.Flatten(), nn.Linear(30, 8), nn.Tanh(),
                          nn.Linear(8, 2)).to(D)  # fmt: skip
    model[0].requires_grad_(False)
    twin = copy.deepcopy(model)
    private = gradhooks.make_private(
        model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        torch.utils.data.TensorDataset(tokens, labels), noise_multiplier=0.0, delta=1e-5,
        steps=4, expected_batch_size=8, max_grad_norm=C, max_physical_batch_size=4,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    seen, steps = [], 0
    for xb, yb in private.batches():
        private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        seen.append((xb, yb))
        if private.step():
            xs, ys = torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
            want = {n: torch.zeros_like(p) for n, p in twin.named_parameters() if p.requires_grad}
            if len(ys):
                want, _ = clipped(loop_grad(twin, F.cross_entropy, xs, ys), C)
            with torch.no_grad():  # (the step's zero_grad took .grad: SGD's step on it)
                for n, q in twin.named_parameters():
                    if q.requires_grad:
                        q -= 0.5 * want[n] / 8
            for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"step {steps}: {n}")
            assert all(len(s[1]) <= 4 for s in seen)
            seen, steps = [], steps + 1
    private.close()
    assert steps == private.steps_taken == 4
    assert model[0].weight.grad is None and torch.equal(model[0].weight, twin[0].weight)


# -- mistakes DP users make -----------------------------------------------------------------------


def test_losses_divided_by_the_batch_before_the_step_are_clipped_as_given():
    """``losses / len(batch)`` (a habit from mean losses) handed to the step: the step clips the
    gradients of the losses it is given, each ``g_i / B``, whose norms are B times smaller;
    the step is the loop's of the divided loss, and so unlike the intended one wherever an
    example's norm exceeds ``C``. Nothing refuses it: the documented meaning is kept."""
    x, y = data(8)
    model, twin = mlp(), mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        norms = gradhooks.dp_sgd_step(h, losses(model, x, y) / 8, max_norm=0.2,
                                      noise_multiplier=0.0, expected_batch_size=E)  # fmt: skip
    want, want_norms = clipped(loop_grad(twin, lambda o, t: F.cross_entropy(o, t) / 8, x, y), 0.2)
    assert (want_norms > 0.2).any() and (want_norms < 0.2).any()
    torch.testing.assert_close(norms, want_norms)
    assert_grads({n: p.grad * E for n, p in model.named_parameters()}, want, "divided")
    intended, intended_norms = clipped(loop_grad(twin, F.cross_entropy, x, y), 0.2)
    torch.testing.assert_close(intended_norms, 8 * norms)
    off = (intended["0.weight"] - model[0].weight.grad * E).norm()
    assert off > 0.1 * intended["0.weight"].norm()


def test_clip_grad_norm_after_the_dp_step_scales_the_noisy_gradient_as_post_processing():
    """``clip_grad_norm_`` called after the DP step, out of habit: it scales the noisy,
    already private ``.grad`` as a whole (post-processing, no privacy cost); the step's
    clipping is unaffected."""
    x, y = data(8)
    model, twin = mlp(), mlp()
    noise, again = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(h, losses(model, x, y), max_norm=C, noise_multiplier=SIGMA,
                              generator=noise, expected_batch_size=E)  # fmt: skip
    noisy = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scale = min(1.0, 0.05 / (float(total) + 1e-6))
    assert scale < 1
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, noisy[n] * scale)
        p.grad = noisy[n]
    want, _ = clipped(loop_grad(twin, F.cross_entropy, x, y), C)
    assert_grads(denoised(model, again, SIGMA * C, E), want, "before clip_grad_norm_")


@pytest.mark.parametrize("shape", ["column", "tokens"])
def test_losses_of_one_column_or_one_per_token_are_refused_before_the_backward(shape):
    """``BCEWithLogits(reduction="none")`` on ``[batch, 1]`` logits, or a language model's
    per-token losses: not one loss per example; refused, naming the shape, with nothing
    written."""
    x, _ = data(6)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1 if shape == "column" else 3))
    model = model.to(D)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, torch.ones_like(out), reduction="none")
        with pytest.raises(gradhooks.ConfigurationError, match=r"\[batch\], got \(6, [13]\)"):
            gradhooks.dp_sgd_step(h, loss, max_norm=C, noise_multiplier=SIGMA)
    assert all(p.grad is None for p in model.parameters())


def test_the_noise_drawn_twice_dp_sgd_step_then_a_dp_optimizer_step_is_refused():
    """A loop that calls ``dp_sgd_step`` and also steps a ``DPOptimizer`` (noise twice): the
    optimizer has no backward of its own, refuses, and leaves the step's ``.grad``."""
    x, y = data(8)
    model = mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h,
                                    max_grad_norm=C, noise_multiplier=SIGMA,
                                    expected_batch_size=E)  # fmt: skip
        gradhooks.dp_sgd_step(h, losses(model, x, y), max_norm=C, noise_multiplier=SIGMA,
                              expected_batch_size=E)  # fmt: skip
        grads = [p.grad.clone() for p in model.parameters()]
        weights = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(gradhooks.StateError, match="no backward"):
            opt.step()
    for p, g, w in zip(model.parameters(), grads, weights, strict=True):
        assert torch.equal(p.grad, g) and torch.equal(p, w)


def test_bert_physical_batches_padded_each_to_its_own_length_in_one_logical_batch():
    """Dynamic padding: each physical batch of a logical batch padded to its own longest
    sequence (another shape at every backward), and a bfloat16 autocast forward: the step is
    the loop's clipped sum of every example with its own padding, within bfloat16's
    rounding."""
    model = _bert().float()
    twin = copy.deepcopy(model).to(D)
    parts = [_padded(20, n=3, length=6), _padded(21, n=2, length=3)]
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h,
                                    max_grad_norm=0.5, noise_multiplier=0.0,
                                    expected_batch_size=E)  # fmt: skip
        for ids, mask, y in parts:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=mask)
            opt.backward(F.cross_entropy(out.logits.float(), y, reduction="none"))
        opt.step()
    per = [loop_grad(twin, _classifier_loss, (ids, mask), y) for ids, mask, y in parts]
    want, _ = clipped({n: torch.cat([p[n] for p in per]) for n in per[0]}, 0.5)
    for n, p in model.named_parameters():
        err = (p.grad.to(D) * E - want[n]).norm()
        assert err <= 5 * 2**-7 * 0.5, f"{n} off by {err:.3g}"  # 5 examples, each ≤ C


class _Tokenized(torch.utils.data.Dataset):
    """A tokenized text data set as ``datasets.map`` leaves it: one dict per example."""

    def __init__(self, n: int = 12):
        self.ids, self.mask, self.labels = _padded(30, n=n)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        keep = self.mask[i].bool()
        return {"input_ids": self.ids[i][keep], "labels": self.labels[i]}


def _pad_to_longest(items):
    """Hugging Face's ``DataCollatorWithPadding`` written out: right-padded ids, their mask
    and the labels, in a ``BatchEncoding``."""
    transformers = pytest.importorskip("transformers")
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, it in enumerate(items):
        ids[row, : len(it["input_ids"])] = it["input_ids"]
        mask[row, : len(it["input_ids"])] = 1
    labels = torch.stack([it["labels"] for it in items])
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


class _MaskedMeanClassifier(nn.Module):
    """Token embeddings averaged over the attention mask, then a head: a text classifier that,
    unlike transformers' BERT (whose attention reshapes by ``-1``), runs on 0 rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 8, dtype=D)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(D)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(D)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)


def test_poisson_loader_of_batch_encodings_with_empty_draws_in_dp_steps():
    """A Hugging Face collator's ``BatchEncoding`` batches from ``poisson_loader``, some draws
    empty: an empty batch is a ``BatchEncoding`` of 0 rows (not the first example, which the
    collate of one example "cut to 0 rows" held before, a ``BatchEncoding`` being no pytree
    node), and its step is the noise alone; the others are the loop's clipped sums."""
    data_set = _Tokenized()
    model = _MaskedMeanClassifier()
    twin = copy.deepcopy(model)
    loader = gradhooks.poisson_loader(data_set, 1.0, steps=6, collate_fn=_pad_to_longest,
                                      generator=torch.Generator().manual_seed(0))  # fmt: skip
    empty = loader.collate_fn([])  # (what the loader makes of an empty draw)
    assert type(empty) is type(loader.collate_fn([data_set[0]]))
    assert all(v.shape[0] == 0 for v in empty.values())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    noise, again = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sizes = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for batch in [*loader, empty]:
            sizes.append(len(batch["labels"]))
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            gradhooks.dp_sgd_step(
                h, F.cross_entropy(logits, batch["labels"], reduction="none"), max_norm=0.5,
                noise_multiplier=SIGMA, generator=noise, expected_batch_size=1.0,
            )  # fmt: skip
            want = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
            if sizes[-1]:
                inputs = (batch["input_ids"], batch["attention_mask"])
                want, _ = clipped(loop_grad(twin, F.cross_entropy, inputs, batch["labels"]), 0.5)
            assert_grads(denoised(model, again, SIGMA * 0.5, 1.0), want, f"batch of {sizes[-1]}")
            opt.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    q.copy_(p)
    assert 0 in sizes and any(sizes), sizes


def test_poisson_loader_refuses_an_empty_batch_it_cannot_cut_to_0_rows():
    """A collate function that returns its own class (a dataclass batch): an empty draw cannot
    be made by cutting the collate of one example, which would hold that example; refused
    when it comes, naming the class."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    x, y = data(10)
    data_set = torch.utils.data.TensorDataset(x, y)
    loader = gradhooks.poisson_loader(
        data_set, 2.0, collate_fn=lambda items: Batch(*torch.utils.data.default_collate(items))
    )
    assert loader.collate_fn([data_set[1], data_set[2]]).x.shape == (2, 6)
    with pytest.raises(gradhooks.ConfigurationError, match="returned a .*Batch, which cannot"):
        loader.collate_fn([])


def _centred(per_example: torch.Tensor) -> torch.Tensor:
    return per_example - per_example.mean()


@pytest.mark.parametrize("method", ["bookkeeping", "ghost", "grad1"])
@pytest.mark.parametrize(
    "made_per_example",
    [
        pytest.param(lambda out, y: F.cross_entropy(out, y).expand(len(y)), id="mean-expanded"),
        pytest.param(
            lambda out, y: F.cross_entropy(out, y) * torch.ones(len(y), dtype=D),
            id="mean-times-ones",
        ),
        pytest.param(
            lambda out, y: _centred(F.cross_entropy(out, y, reduction="none")),
            id="centred-on-the-batch-mean",
        ),
    ],
)
def test_a_batch_mean_passed_off_as_per_example_losses_is_refused_by_the_steps_check(
    made_per_example, method
):
    """Losses of the right shape ``[batch]`` whose every entry depends on every example (the
    mean loss broadcast to the batch, or each loss less the batch's mean, a baseline): no
    entry is an example's own loss, so no clipping of it bounds one example's influence. The
    step's check against autograd refuses it (``CheckFailedError``), writing nothing."""
    x, y = data(8)
    model = mlp()
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        with pytest.raises(gradhooks.CheckFailedError, match="examples' own losses"):
            gradhooks.dp_sgd_step(h, made_per_example(model(x), y), max_norm=0.5,
                                  noise_multiplier=SIGMA, method=method)  # fmt: skip
    assert all(p.grad is None for p in model.parameters())


def test_make_private_over_a_loader_of_batch_encodings_steps_on_empty_draws_alone():
    """``make_private`` given a ``DataLoader`` whose collate is a Hugging Face style
    ``BatchEncoding`` padder, an expected batch of 1.5 (some logical batches empty): each
    step's update is SGD on the loop's clipped sum of the examples drawn, and an empty draw
    leaves the weights as they were (no example stands in for it)."""
    data_set = _Tokenized()
    model = _MaskedMeanClassifier()
    twin = copy.deepcopy(model)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        torch.utils.data.DataLoader(data_set, batch_size=4, collate_fn=_pad_to_longest),
        noise_multiplier=0.0, delta=1e-5, steps=6, expected_batch_size=1.5, max_grad_norm=0.5,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    sizes, seen = [], []
    for batch in private.batches():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        private.backward(F.cross_entropy(logits, batch["labels"], reduction="none"))
        seen.append(batch)
        if not private.step():
            continue
        sizes.append(sum(len(b["labels"]) for b in seen))
        per = [
            loop_grad(twin, F.cross_entropy, (b["input_ids"], b["attention_mask"]), b["labels"])
            for b in seen
            if len(b["labels"])
        ]
        if per:
            want, _ = clipped({n: torch.cat([p[n] for p in per]) for n in per[0]}, 0.5)
            with torch.no_grad():
                for n, q in twin.named_parameters():
                    q -= 0.5 * want[n] / 1.5
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"step {len(sizes)}: {n}")
        seen = []
    private.close()
    assert 0 in sizes and any(sizes), sizes


def test_make_private_given_a_shuffled_loader_of_fixed_batches_draws_poisson_batches():
    """The habit of sampling without replacement: a ``DataLoader(batch_size=8, shuffle=True)``
    handed to ``make_private``, whose accountant assumes Poisson sampling. Its data set and
    collate are kept and its batches replaced, as documented: the logical batches vary in
    size around the expected 8, and the accountant records q = 8 / n at every step."""
    x, y = data(40)
    model = mlp()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                         shuffle=True, drop_last=True)  # fmt: skip
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
        delta=1e-5, steps=6, expected_batch_size=8, max_grad_norm=C,
        generator=torch.Generator().manual_seed(4),
    )  # fmt: skip
    sizes = []
    for xb, yb in private.batches():
        private.backward(losses(model, xb, yb))
        sizes.append(len(yb))
        private.step()
    private.close()
    assert len(sizes) == private.steps_taken == 6 and len(set(sizes)) > 1, sizes
    assert [tuple(h) for h in private.accountant.history] == [(1.0, 8 / 40, 6)]

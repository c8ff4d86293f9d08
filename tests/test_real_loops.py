"""Training loops as real projects write them, each step checked against the float64 oracle.

Each test follows the idioms of one kind of published training script (the PyTorch examples'
MNIST, word language model and DCGAN loops and the tutorials' manual and fused-optimizer loops,
nanoGPT's accumulation loop, timm's ``train_one_epoch`` and torchvision's reference loop,
Hugging Face's accelerate-free fine-tuning loop, Opacus' and private-transformers' DP loops, the
autograd-hacks recipe, SAM, AWD-LSTM's weight drop, ULMFiT's gradual unfreezing, torchdiffeq's
``func(t, y)``, quantization-aware training) on a small model, and at every step compares
``grad1`` (and the norms or the DP step where the loop uses them) with each example's own
gradient by a per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`, or a loop written
out where the examples are not on dimension 0), within a stated tolerance under mixed
precision, or checks that a misuse stops with an error that says what went wrong.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, tiny_bert_config

D = torch.float64


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad1.clone() for n, p in model.named_parameters() if hasattr(p, "grad1")}


def assert_same(model, twin, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach(), q.detach(), f"{what}: parameter {n}")


def scaled(want: dict, c: float) -> dict:
    return {n: c * g for n, g in want.items()}


def added(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {n: a[n] + b[n] for n in b}


# -- the PyTorch examples' MNIST loop -------------------------------------------------------------


class MnistNet(nn.Module):
    """The MNIST example's network, shrunk: two convolutions, max-pooling, two Linear layers,
    log_softmax (the example's dropout is left out: its mask cannot be replayed by the loop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3)
        self.fc1, self.fc2 = nn.Linear(6 * 2 * 2, 8), nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def test_mnist_example_loop_with_steplr_and_a_summed_test_pass():
    """zero_grad, forward, ``nll_loss``, backward, Adadelta step, StepLR at each epoch's end,
    and between epochs a test pass in eval mode under ``no_grad`` with ``reduction="sum"`` on
    a batch of another size: every training step's grad1 is its examples' own gradients."""
    model = MnistNet().to(D)
    twin = copy.deepcopy(model)
    opts = [torch.optim.Adadelta(m.parameters(), lr=1.0) for m in (model, twin)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in opts]
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for step in range(2):
                x = torch.randn(5, 1, 8, 8, generator=g, dtype=D)
                y = torch.randint(10, (5,), generator=g)
                want = loop_grad(twin, F.nll_loss, x, y)
                for m, o in zip((model, twin), opts):
                    o.zero_grad()
                    F.nll_loss(m(x), y).backward()
                    o.step()
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                assert_same(model, twin, f"epoch {epoch} step {step}")
            model.eval()
            with torch.no_grad():
                xt = torch.randn(7, 1, 8, 8, generator=g, dtype=D)
                yt = torch.randint(10, (7,), generator=g)
                F.nll_loss(model(xt), yt, reduction="sum").item()
            assert model.fc2.weight.grad1.shape[0] == 5  # the test pass captured nothing
            for s in scheds:
                s.step()


# -- the tutorials' loop without an optimizer -----------------------------------------------------


@pytest.mark.parametrize("zero", ["grad.zero_", "grad.data.zero_", "grad = None"])
def test_manual_sgd_with_the_gradients_zeroed_by_hand(zero):
    """The "learning PyTorch with examples" loop: backward, ``p.data -= lr * p.grad.data``,
    then each gradient zeroed by hand (``p.grad.data.zero_()`` in the older versions, which
    torch does not count as a change of ``.grad``): every step's grad1 is that step's alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 1)).to(D)
    mse = lambda out, y: F.mse_loss(out, y, reduction="sum")  # noqa: E731
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x, y = torch.randn(5, 3, generator=g, dtype=D), torch.randn(5, 1, generator=g, dtype=D)
            want = loop_grad(model, mse, x, y)
            mse(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():
                p.data -= 1e-2 * p.grad.data
                if zero == "grad.zero_":
                    p.grad.zero_()
                elif zero == "grad.data.zero_":
                    p.grad.data.zero_()
                else:
                    p.grad = None


# -- the PyTorch examples' word language model ----------------------------------------------------


class RNNModel(nn.Module):
    """The word language model's network, shrunk: an Embedding, a 2-layer LSTM or GRU on
    time-major input ``[T, batch]``, a decoder whose weight is tied to the embedding's."""

    def __init__(self, kind: str, ntoken: int = 11, nhid: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.nhid = kind, nhid
        self.encoder = nn.Embedding(ntoken, nhid)
        self.rnn = getattr(nn, kind)(nhid, nhid, 2)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight

    def forward(self, inp, hidden):
        out, hidden = self.rnn(self.encoder(inp), hidden)
        return self.decoder(out), hidden

    def init_hidden(self, batch: int):
        h = torch.zeros(2, batch, self.nhid, dtype=D)
        return (h, h.clone()) if self.kind == "LSTM" else h


def _detached(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(_detached(t) for t in h)


def _column(h, i: int):
    return h[:, i : i + 1] if isinstance(h, torch.Tensor) else tuple(_column(t, i) for t in h)


def _time_major_loop(model, hooks, inp, target, hidden) -> dict:
    """Each sequence's own gradient: the model on column ``i`` of the time-major batch, with
    column ``i`` of the carried hidden state, its tokens' mean cross-entropy."""
    params = dict(model.named_parameters())
    rows = {n: [] for n in params}
    with hooks.paused():
        for i in range(inp.shape[1]):
            out, _ = model(inp[:, i : i + 1], _column(hidden, i))
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target[:, i])
            for n, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
                rows[n].append(g)
    return {n: torch.stack(r) for n, r in rows.items()}


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_word_language_model_loop_time_major_with_the_hidden_state_carried(kind):
    """Batches of ``[bptt, batch]`` tokens, ``batch_dim=1``; the hidden state carried from
    batch to batch, detached (``repackage_hidden``); the loss over the flattened ``[T*B]``
    tokens; ``clip_grad_norm_`` and the update by hand (``p.data.add_(p.grad, alpha=-lr)``)
    after ``model.zero_grad()``. The tied encoder/decoder weight has one grad1 (its two
    uses)."""
    bptt, batch, model = 4, 3, RNNModel(kind).to(D)
    data = torch.randint(11, (3 * bptt + 1, batch), generator=torch.Generator().manual_seed(0))
    hidden = model.init_hidden(batch)
    with gradhooks.add_hooks(model, batch_dim=1) as h:
        for k in range(3):
            inp, target = data[k * bptt : (k + 1) * bptt], data[k * bptt + 1 : (k + 1) * bptt + 1]
            hidden = _detached(hidden)
            want = _time_major_loop(model, h, inp, target, hidden)
            model.zero_grad()
            out, hidden = model(inp, hidden)
            F.cross_entropy(out.view(-1, 11), target.reshape(-1)).backward()
            assert_grad1(model, want, f"{kind} batch {k}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-1.0)


def test_word_language_model_without_batch_dim_is_refused_naming_the_rnn():
    """Forgetting ``batch_dim=1`` on the time-major model: the batch is taken from dimension 0
    (the time steps), which the LSTM's rule does not read it from: an error naming the layer
    and the remedy, before any grad1 is written."""
    model = RNNModel("LSTM").to(D)
    inp = torch.randint(11, (4, 3))
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'rnn'.*batch_dim"):
            out, _ = model(inp, model.init_hidden(3))
            F.cross_entropy(out.view(-1, 11), inp.reshape(-1)).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


# -- the PyTorch examples' DCGAN loop ------------------------------------------------------------


def test_dcgan_loop_two_hooked_models_and_the_generator_step_through_the_discriminator():
    """Two handles (generator, discriminator; LayerNorm for the example's BatchNorm). The
    discriminator step: ``netD.zero_grad()``, a backward on the real batch, then one on
    ``netG(z).detach()``: its grad1 holds each example's real and fake terms. The generator
    step: ``netG.zero_grad()`` only, a backward through the discriminator (whose grad1 and
    .grad then hold the generator step's too, as .grad does, until its next zero_grad)."""
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(2, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 4)).to(D)
    netD = nn.Sequential(nn.Linear(4, 6), nn.LeakyReLU(0.2), nn.Linear(6, 1)).to(D)
    bce = nn.BCEWithLogitsLoss()
    optD, optG = (torch.optim.Adam(m.parameters(), 2e-3, betas=(0.5, 0.999)) for m in (netD, netG))
    g = torch.Generator().manual_seed(0)
    hG, hD = gradhooks.add_hooks(netG), gradhooks.add_hooks(netD)

    def own(loss_of, params) -> dict:
        rows = []
        with hG.paused(), hD.paused():
            for i in range(4):
                rows.append(torch.autograd.grad(loss_of(i), [p for _, p in params]))
        return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}

    try:
        for step in range(2):
            real = torch.randn(4, 4, generator=g, dtype=D)
            z = torch.randn(4, 2, generator=g, dtype=D)
            one, zero = torch.ones(1, 1, dtype=D), torch.zeros(1, 1, dtype=D)
            netD.zero_grad()
            bce(netD(real), one.expand(4, 1)).backward()
            fake = netG(z)
            bce(netD(fake.detach()), zero.expand(4, 1)).backward()
            fk = fake.detach()
            wantD = own(lambda i: bce(netD(real[i : i + 1]), one) + bce(netD(fk[i : i + 1]), zero),  # noqa: B023
                        list(netD.named_parameters()))  # fmt: skip
            assert_grad1(netD, wantD, f"step {step}, discriminator")
            optD.step()
            netG.zero_grad()
            bce(netD(fake), one.expand(4, 1)).backward()
            wantG = own(lambda i: bce(netD(netG(z[i : i + 1])), one), list(netG.named_parameters()))  # noqa: B023
            assert_grad1(netG, wantG, f"step {step}, generator")
            optG.step()
    finally:
        hG.remove()
        hD.remove()


# -- nanoGPT's training loop ----------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, c: int = 8, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.p, self.drop = heads, dropout, nn.Dropout(dropout)
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2) for u in (q, k, v))
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    """nanoGPT's model, shrunk: token and position embeddings, two blocks of causal
    self-attention and MLP, the head's weight tied to the token embedding, and the loss
    computed inside ``forward`` when targets are given (cross-entropy over ``[B*T]``)."""

    def __init__(self, vocab: int = 13, block: int = 6, c: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(block, c)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(c, dropout=dropout), Block(c, dropout=dropout)])
        self.ln_f = nn.LayerNorm(c)
        self.lm_head = nn.Linear(c, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def _lm_loss(out, targets):
    logits = out[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_nanogpt_loop_accumulation_loss_inside_the_model_and_clipping():
    """nanoGPT's loop in float64: ``gradient_accumulation_steps`` micro-batches, each
    ``loss = loss / steps`` from the loss the model returns, backward; then
    ``clip_grad_norm_``, AdamW over decay/no-decay parameter groups, ``zero_grad(set_to_none=
    True)``. grad1 after the last micro-batch: each row the sum of its micro-batch rows over
    the number of steps."""
    model, steps = GPT().to(D), 2
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for it in range(2):
            want = None
            for _ in range(steps):
                x, y = (
                    torch.randint(13, (3, 6), generator=g),
                    torch.randint(13, (3, 6), generator=g),
                )
                want = added(want, scaled(loop_grad(model, _lm_loss, x, y), 1 / steps))
                _, loss = model(x, y)
                (loss / steps).backward()
            assert_grad1(model, want, f"iter {it}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_nanogpt_finetuning_with_dropout_in_and_after_the_attention():
    """nanoGPT's fine-tuning configs (``dropout=0.1`` and up): dropout on the embeddings, in
    ``scaled_dot_product_attention`` (``dropout_p`` while training) and after each
    projection. The masks drawn cannot be drawn again by a loop, so each example's gradient
    is taken from the same forward: autograd's gradient of its own loss alone (the examples
    are not mixed, so that is its gradient with the masks it got)."""
    model = GPT(dropout=0.2).to(D).train()
    params, names = list(model.parameters()), [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model) as h:
        for it in range(2):
            x, y = torch.randint(13, (3, 6), generator=g), torch.randint(13, (3, 6), generator=g)
            losses = F.cross_entropy(model(x)[0].permute(0, 2, 1), y, reduction="none").mean(1)
            with h.paused():
                rows = [torch.autograd.grad(losses[i], params, retain_graph=True) for i in range(3)]
            model.zero_grad()
            losses.mean().backward()
            want = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}
            assert_grad1(model, want, f"iter {it}")


def test_nanogpt_step_under_bfloat16_autocast():
    """nanoGPT's ``ctx = torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward
    (float32 parameters; the scaler is off for bfloat16). grad1 against the float64 loop:
    every Linear runs in bfloat16 (8 bits of mantissa, a relative rounding of 2^-8 = 0.4%);
    through two blocks the errors add up to ~1% of the largest entry (seen: up to 1.2%):
    the tolerance is 4% of each parameter's largest entry, well below the size of a wrong
    example's gradient."""
    model = GPT()
    ref = copy.deepcopy(model).to(D)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for it in range(2):
            x, y = torch.randint(13, (3, 6), generator=g), torch.randint(13, (3, 6), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            want = loop_grad(ref, _lm_loss, x, y)
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float32, n
                err = (p.grad1.double() - want[n]).abs().max() / want[n].abs().max()
                assert err < 0.04, f"iter {it}: {n} off by {err:.3f} of its largest entry"
            model.zero_grad(set_to_none=True)


# -- a float16 loop with a GradScaler (timm's NativeScaler, nanoGPT with float16) -----------------


def test_grad_scaler_loop_grad1_is_of_the_scaled_loss_and_an_overflow_step_is_skipped():
    """``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``, ``clip_grad_norm_``,
    ``scaler.step(opt)``, ``scaler.update()``, ``opt.zero_grad()``, under float16 autocast.
    grad1 is the per-example gradient of the loss that was backpropagated, the scaled one
    (``S`` times each example's own; ``unscale_`` and clipping change ``.grad`` only, as
    ``docs/training.md`` says); the first step's scale overflows: grad1 holds the Inf, the
    scaler skips the step and lowers the scale; the later steps are exact up to float16
    (10 bits of mantissa: seen 5e-4 of the largest entry; tolerance 1e-2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-16)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = torch.randn(4, 3, generator=g), torch.randint(2, (4,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
            finite = all(torch.isfinite(p.grad1).all() for p in model.parameters())
            if step == 0:
                assert not finite, "the first scale was meant to overflow"
            else:
                want = loop_grad(ref, F.cross_entropy, x.to(D), y)
                for n, p in model.named_parameters():
                    err = (p.grad1.double() / scale - want[n]).abs().max() / want[n].abs().max()
                    assert err < 1e-2, f"step {step}: {n} off by {err:.2e}"
            scaler.unscale_(opt)
            for n, p in model.named_parameters():  # .grad unscaled, grad1 as the backward left it
                if finite:  # (float32 sums of float16 products, in two orders)
                    err = (p.grad1.mean(0) / scale - p.grad).abs().max() / p.grad.abs().max()
                    assert err < 1e-3, f"step {step}: {n} grad1.mean(0)/S vs .grad, {err:.2e}"
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            assert (scaler.get_scale() < scale) == (not finite)
            if finite:
                for p, q in zip(model.parameters(), ref.parameters()):
                    q.data.copy_(p.data)
            opt.zero_grad()


# -- timm's train_one_epoch ---------------------------------------------------------------------


class SmallConvNet(nn.Module):
    """A timm-like image classifier, shrunk: a stem convolution, GroupNorm (BatchNorm in train
    mode mixes the examples), a second convolution, global pooling, a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.norm = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.conv, self.head = nn.Conv2d(4, 6, 3, stride=2), nn.Linear(6, 5)

    def forward(self, x):
        x = F.silu(self.conv(F.silu(self.norm(self.stem(x)))))
        return self.head(x.mean((2, 3)))


def soft_target_ce(out, target):
    return torch.sum(-target * F.log_softmax(out, dim=-1), dim=-1).mean()


def test_timm_train_one_epoch_with_mixup_accumulation_ema_and_channels_last():
    """timm's loop: the model and every batch ``channels_last``; mixup before the model (each
    mixed image is an example; its soft target ``SoftTargetCrossEntropy``'s); ``accum_steps``
    micro-batches with ``loss / accum_steps``, the update on the last (``need_update``), then
    ``optimizer.zero_grad()``; the EMA copy (a deep copy of the hooked model, which is not
    hooked) updated by ``torch._foreach_lerp_`` under ``no_grad`` after each update, and a
    validation pass of the model and of the EMA in eval mode with label smoothing between
    the epochs."""
    model = SmallConvNet().to(D).to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    g = torch.Generator().manual_seed(0)
    accum = 2
    with gradhooks.add_hooks(model):
        ema = copy.deepcopy(model).eval().requires_grad_(False)
        for epoch in range(2):
            model.train()
            want = None
            for i in range(2 * accum):
                x = torch.randn(4, 3, 6, 6, generator=g, dtype=D)
                y = F.one_hot(torch.randint(5, (4,), generator=g), 5).to(D)
                lam = 0.7
                x = (lam * x + (1 - lam) * x.flip(0)).contiguous(memory_format=torch.channels_last)
                y = lam * y + (1 - lam) * y.flip(0)
                twin.load_state_dict(model.state_dict())
                want = added(want, scaled(loop_grad(twin, soft_target_ce, x, y), 1 / accum))
                (soft_target_ce(model(x), y) / accum).backward()
                if (i + 1) % accum == 0:  # need_update
                    assert_grad1(model, want, f"epoch {epoch} update {i // accum}")
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                    opt.step()
                    opt.zero_grad()
                    want = None
                    with torch.no_grad():
                        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
            sched.step()
            assert not any(hasattr(p, "grad1") for p in ema.parameters())
            model.eval()
            with torch.no_grad():
                xv = torch.randn(6, 3, 6, 6, generator=g, dtype=D)
                yv = torch.randint(5, (6,), generator=g)
                for m in (model, ema):
                    F.cross_entropy(m(xv), yv, label_smoothing=0.1).item()


# -- Hugging Face's fine-tuning loop without Trainer (run_glue_no_trainer) ------------------------


def test_hf_sequence_classification_loop_with_padding_accumulation_and_warmup():
    """A BERT classifier as ``run_glue_no_trainer`` trains it: ``outputs = model(**batch)``
    with ``labels`` (the loss computed inside the model, the batch mean of one label per
    example), right padding with an ``attention_mask``, ``loss / gradient_accumulation_steps``,
    AdamW with the no-decay groups (biases and LayerNorm weights), a linear warmup schedule,
    ``optimizer.zero_grad()`` after each update. Each example's own gradient: the model on
    that example alone, unpadded."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = tiny_bert_config(num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).to(D)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, 4)
    g = torch.Generator().manual_seed(0)
    accum = 2

    def own(ids, mask, labels) -> dict:
        params = [p for p in model.parameters() if p.requires_grad]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        rows = []
        with h.paused():
            for i in range(ids.shape[0]):
                n = int(mask[i].sum())
                out = model(input_ids=ids[i : i + 1, :n], labels=labels[i : i + 1])
                rows.append(torch.autograd.grad(out.loss, params, allow_unused=True))
        return {
            n: torch.stack(
                [r[k] if r[k] is not None else torch.zeros_like(params[k]) for r in rows]
            )
            for k, n in enumerate(names)
        }

    with gradhooks.add_hooks(model) as h:
        model.train()
        want = None
        for step in range(2 * accum):
            lengths = torch.tensor([5, 3, 4])
            ids = torch.randint(1, 20, (3, 5), generator=g)
            mask = (torch.arange(5)[None] < lengths[:, None]).long()
            ids = ids * mask
            labels = torch.randint(3, (3,), generator=g)
            want = added(want, scaled(own(ids, mask, labels), 1 / accum))
            outputs = model(input_ids=ids, attention_mask=mask, labels=labels)
            (outputs.loss / accum).backward()
            if (step + 1) % accum == 0:
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"update {step // accum}: {n}")
                opt.step()
                sched.step()
                opt.zero_grad()
                want = None
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask).logits.argmax(-1)


# -- DP loops: Opacus' virtual steps, private-transformers' per-sequence losses -------------------


def clipped_mean(per_example: dict, max_norm: float, divisor: float) -> dict:
    """``Σᵢ min(1, C/‖gᵢ‖) gᵢ / divisor`` from each example's own gradients (whole-model
    norms), what a DP-SGD step without noise puts in ``.grad``."""
    norms = torch.cat([g.flatten(1) for g in per_example.values()], 1).norm(dim=1)
    factors = (max_norm / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factors, g) / divisor for n, g in per_example.items()}


def test_opacus_style_virtual_steps_with_dp_optimizer():
    """Opacus' ``BatchMemoryManager`` loop: a logical batch in physical batches of another
    size, ``optimizer.backward`` (here ``DPOptimizer.backward``) for each, one ``step`` and
    ``zero_grad`` per logical batch. Without noise, each step's ``.grad`` is the clipped
    per-example gradients of every example of its physical batches, summed, over the
    expected batch size; the parameters follow SGD on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 3)).to(D)
    twin = copy.deepcopy(model)
    h = gradhooks.add_hooks(model, quantities=("norms",))
    opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), h,
                                max_grad_norm=0.3, noise_multiplier=0.0,
                                expected_batch_size=7.0)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with h:
        for step in range(2):
            physical = [(torch.randn(b, 3, generator=g, dtype=D), torch.randint(3, (b,), generator=g))
                        for b in (4, 3, 2)]  # fmt: skip
            x = torch.cat([p[0] for p in physical])
            y = torch.cat([p[1] for p in physical])
            want = clipped_mean(loop_grad(twin, F.cross_entropy, x, y), 0.3, 7.0)
            for xb, yb in physical:
                opt.backward(F.cross_entropy(model(xb), yb, reduction="none"))
            assert opt.step()
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"step {step}: {n}")
            opt.zero_grad()
            with torch.no_grad():
                for n, q in twin.named_parameters():
                    q -= 0.5 * want[n]
            assert_same(model, twin, f"step {step}")


def test_private_transformers_style_per_sequence_losses_into_dp_sgd_step():
    """private-transformers' loop: the LM's per-token losses, ``reduction="none"``, averaged
    over each sequence's own tokens into a ``[batch]`` vector, handed to the DP step instead
    of ``loss.backward()`` (``optimizer.step(loss=...)`` there, ``dp_sgd_step`` here); the
    returned norms are each sequence's own gradient norm and ``.grad`` the clipped mean."""
    model = GPT().to(D)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(13, (3, 6), generator=g), torch.randint(13, (3, 6), generator=g)
            want = loop_grad(model, _lm_loss, x, y)
            logits, _ = model(x)
            losses = F.cross_entropy(logits.permute(0, 2, 1), y, reduction="none").mean(1)
            norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
            assert_close(norms, torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1),
                         f"step {step}: norms")  # fmt: skip
            expected = clipped_mean(want, 0.5, 3)
            for n, p in model.named_parameters():
                assert_close(p.grad, expected[n], f"step {step}: {n}")
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()


# -- the autograd-hacks recipe ------------------------------------------------------------------


def test_autograd_hacks_recipe_over_several_steps():
    """autograd-hacks' README, with ``import gradhooks as autograd_hacks``: ``add_hooks``,
    forward, backward, ``compute_grad1(model, loss_type="sum")``, read ``grad1``, then
    ``clear_backprops`` and the optimizer's ``zero_grad`` before the next step."""
    import gradhooks as autograd_hacks

    model = MnistNet().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nll_sum = lambda out, y: F.nll_loss(out, y, reduction="sum")  # noqa: E731
    autograd_hacks.add_hooks(model)
    try:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = (
                torch.randn(3, 1, 8, 8, generator=g, dtype=D),
                torch.randint(10, (3,), generator=g),
            )
            want = loop_grad(model, nll_sum, x, y)
            opt.zero_grad()
            nll_sum(model(x), y).backward()
            autograd_hacks.compute_grad1(model, loss_type="sum")
            assert_grad1(model, want, f"step {step}")
            autograd_hacks.clear_backprops(model)
            opt.step()
    finally:
        autograd_hacks.remove_hooks(model)


# -- optimizers that take several backwards per step ---------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)


def batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def test_sam_two_passes_with_the_weights_perturbed_in_place_between_them():
    """Sharpness-aware minimisation (the ``SAM`` optimizer's ``first_step`` / ``second_step``):
    a backward at ``w``, ``p.add_(e_w)`` under ``no_grad``, ``zero_grad``, a second forward and
    backward at ``w + e``, ``p.sub_(e_w)``, the base step. Each pass's grad1 is its own, at
    the weights it ran at."""
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, first pass")
            norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
            with torch.no_grad():
                e_w = [p.grad * 0.05 / (norm + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), e_w):
                    p.add_(e)
            base.zero_grad()
            want = loop_grad(model, F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}, second pass")
            with torch.no_grad():
                for p, e in zip(model.parameters(), e_w):
                    p.sub_(e)
            base.step()
            base.zero_grad()


def test_lbfgs_closure_evaluated_several_times_per_step():
    """``optimizer.step(closure)`` with LBFGS: the closure zeroes, forwards and backwards
    several times per step; after the step, grad1 is that of the last evaluation, whose
    gradient ``.grad`` holds (grad1 reduces to it) and whose weights the oracle is run at."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = batch(0)
    evaluations = []

    def closure():
        opt.zero_grad()
        evaluations.append([p.detach().clone() for p in model.parameters()])
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with gradhooks.add_hooks(model):
        opt.step(closure)
        assert len(evaluations) > 1
        at = copy.deepcopy(model)
        for q, w in zip(at.parameters(), evaluations[-1]):
            q.data.copy_(w)
        assert_grad1(model, loop_grad(at, F.cross_entropy, x, y), "last evaluation")
        for p in model.parameters():
            assert_close(p.grad1.mean(0), p.grad, ".grad")


# -- adversarial and domain-adversarial training -------------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_pgd_adversarial_training_attack_backwards_then_zero_grad(set_to_none):
    """Madry-style adversarial training: the attack's steps call ``loss.backward()`` on an
    input that requires grad (filling the parameters' ``.grad`` and grad1 too), then
    ``optimizer.zero_grad()`` and the training backward on the adversarial batch: grad1 is the
    adversarial examples' own gradients alone."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            xa = x.clone().requires_grad_(True)
            for _ in range(2):
                F.cross_entropy(model(xa), y).backward()
                with torch.no_grad():
                    xa += 0.1 * xa.grad.sign()
                xa.grad = None
            xa = xa.detach()
            opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(xa), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, xa, y), f"step {step}")
            opt.step()


class ReverseGrad(torch.autograd.Function):
    """The gradient reversal layer: identity forward, ``-alpha`` times the gradient back."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Linear(3, 6), nn.ReLU())
        self.label = nn.Linear(6, 2)
        self.domain = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x, alpha: float = 0.3):
        f = self.features(x)
        return self.label(f), self.domain(ReverseGrad.apply(f, alpha))


def test_domain_adversarial_training_through_a_gradient_reversal_function():
    """DANN: the features feed the label head directly and the domain head through a custom
    ``autograd.Function`` that reverses the gradient; the loss sums both heads' losses. The
    features' grad1 holds each example's label gradient minus ``alpha`` times its domain
    gradient."""
    model = DANN().to(D)
    two = lambda out, t: F.cross_entropy(out[0], t[:, 0]) + F.cross_entropy(out[1], t[:, 1])  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            t = torch.stack([y, torch.tensor([0, 1, 0, 1])], 1)
            want = loop_grad(model, two, x, t)
            opt.zero_grad()
            two(model(x), t).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- evaluation, skipped batches and partial backwards --------------------------------------------


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_inference_mode_evaluation_between_steps(mode):
    """Lightning's and many scripts' validation under ``torch.inference_mode()`` (in eval or
    still in train mode) on another batch size between the training steps: nothing is
    captured, the next step's grad1 is its own."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            model.train()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()
            model.train(mode == "train")
            with torch.inference_mode():
                model(torch.randn(7, 3, dtype=D)).argmax(1)
            assert model[0].weight.grad1.shape[0] == 4


def test_a_batch_whose_loss_is_skipped_leaves_no_trace():
    """``if not torch.isfinite(loss): continue`` (or any check that drops a batch after its
    forward): the dropped forward's graph, kept alive or not, gives nothing to the next
    batch's grad1."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = batch(step, n=4 if step % 2 else 6)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step % 2 == 0:  # skipped (its loss kept for logging at step 0)
                if step == 0:
                    kept.append(loss)
                continue
            loss.backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()


def test_backward_with_inputs_limits_grad1_to_those_parameters():
    """A GAN-style ``loss.backward(inputs=list(head.parameters()))``: only those parameters get
    ``.grad``, and only those get grad1 (the others none, as their ``.grad`` is ``None``)."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward(inputs=list(model[2].parameters()))
    want = loop_grad(model, F.cross_entropy, x, y)
    for n, p in model.named_parameters():
        if n.startswith("2."):
            assert_close(p.grad1, want[n], n)
        else:
            assert p.grad is None and not hasattr(p, "grad1"), n


def test_reinforce_vector_backward_with_the_advantages():
    """REINFORCE as the PyTorch examples' ``reinforce.py`` weights it: the chosen actions'
    log-probabilities ``[batch]`` backpropagated with ``-advantages`` as the gradient
    (``logp.backward(-adv)``), a summed objective: grad1 with ``loss_reduction="sum"`` is each
    example's ``-adv_i ∇ log π(a_i|s_i)``."""
    model = mlp()
    x, actions = batch(0)
    adv = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))

    def objective(out, t):
        logp = F.log_softmax(out, 1).gather(1, t[:, :1].long()).squeeze(1)
        return -(logp * t[:, 1]).sum()

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        logp = F.log_softmax(model(x), 1).gather(1, actions[:, None]).squeeze(1)
        logp.backward(-adv)
    assert_grad1(model, loop_grad(model, objective, x, torch.stack([actions.to(D), adv], 1)), "")


def test_autograd_backward_of_several_roots():
    """``torch.autograd.backward([loss_a, loss_b])`` (two losses, one call): grad1 holds each
    example's gradient of both."""
    model = mlp()
    x, y = batch(0)
    both = lambda out, y: F.cross_entropy(out, y, reduction="sum") + 0.5 * out.pow(2).sum()  # noqa: E731
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(x)
        torch.autograd.backward([F.cross_entropy(out, y, reduction="sum"), 0.5 * out.pow(2).sum()])
    assert_grad1(model, loop_grad(model, both, x, y), "")


# -- models as real code writes them ---------------------------------------------------------------


class WeightDrop(nn.Module):
    """AWD-LSTM's ``WeightDrop``: the wrapped layer's weight removed from its parameters,
    replaced at every forward by a tensor computed from the wrapper's raw parameter (here a
    fixed DropConnect mask, which the loop can replay)."""

    def __init__(self, module: nn.Linear) -> None:
        super().__init__()
        self.module = module
        raw = module.weight
        del module._parameters["weight"]
        self.weight_raw = nn.Parameter(raw.detach().clone())
        mask = (torch.rand(raw.shape, generator=torch.Generator().manual_seed(3)) > 0.3) / 0.7
        self.register_buffer("mask", mask.to(raw.dtype))

    def forward(self, x):
        self.module.weight = self.weight_raw * self.mask
        return self.module(x)


def test_awd_lstm_weight_drop_sets_the_weight_at_every_forward():
    torch.manual_seed(0)
    model = nn.Sequential(WeightDrop(nn.Linear(3, 5)), nn.Tanh(), nn.Linear(5, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()


class ODEFunc(nn.Module):
    """torchdiffeq's ``func(t, y)``: the first argument a 0-d time, the examples in ``y``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, t, y):
        return self.net(torch.cat([y, t.expand(y.shape[0], 1)], 1))


def test_ode_function_whose_first_argument_is_the_time():
    """Euler steps of ``func(t, y)`` inside the loss: the examples are found in ``y``, not in
    the 0-d ``t`` that comes first."""
    model = ODEFunc().to(D)
    x, _ = batch(0)
    target = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(2))

    def integrate(m, y0):
        y = y0
        for k in range(3):
            y = y + 0.1 * m(torch.tensor(0.1 * k, dtype=D), y)
        return y

    class Solve(nn.Module):
        def __init__(self, func):
            super().__init__()
            self.func = func

        def forward(self, y0):
            return integrate(self.func, y0)

    solver = Solve(model)
    mse = lambda out, t: F.mse_loss(out, t)  # noqa: E731
    want = loop_grad(solver, mse, x, target)
    with gradhooks.add_hooks(model):
        mse(integrate(model, x), target).backward()
    assert_grad1(solver, want, "")


def test_a_batch_dict_as_the_only_argument():
    """Lightning- and Hugging-Face-style ``model(batch)`` with a dict of tensors: the
    examples are found in its first tensor."""

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body, self.head = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, batch):
            return self.head(torch.tanh(self.body(batch["x"]))) * batch["w"]

    model = Classifier().to(D)
    x, y = batch(0)
    w = torch.rand(4, 1, dtype=D, generator=torch.Generator().manual_seed(1))
    want = {n: [] for n, _ in model.named_parameters()}
    for i in range(4):
        out = model({"x": x[i : i + 1], "w": w[i : i + 1]})
        grads = torch.autograd.grad(F.cross_entropy(out, y[i : i + 1]), list(model.parameters()))
        for n, g in zip(want, grads):
            want[n].append(g)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model({"x": x, "w": w, "y": y}), y).backward()
    assert_grad1(model, {n: torch.stack(r) for n, r in want.items()}, "")


def test_load_state_dict_with_assign_mid_training():
    """``model.load_state_dict(state, assign=True)`` (resuming from a checkpoint, new
    Parameter objects): the next steps' grad1 is on the new parameters and is right."""
    model = mlp()
    state = {k: v.clone() * 1.1 for k, v in model.state_dict().items()}
    with gradhooks.add_hooks(model):
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        model.load_state_dict(state, assign=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x, y = batch(step + 1)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()


def test_checkpoint_saved_and_loaded_into_a_fresh_hooked_model():
    """A checkpoint (model and optimizer ``state_dict``) written mid-training by
    ``torch.save`` and loaded into a new model, hooked afresh, as a resumed run does: its
    steps are those of the run that went on."""
    import io

    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        x, y = batch(5)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        went_on = grads_of(model)
    buf.seek(0)
    state = torch.load(buf)
    resumed = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)
    resumed.load_state_dict(state["model"])
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(state["opt"])
    with gradhooks.add_hooks(resumed):
        opt2.zero_grad()
        F.cross_entropy(resumed(x), y).backward()
        assert_grad1(resumed, went_on, "resumed")


def test_data_parallel_wrapper_on_one_device():
    """``nn.DataParallel(model)`` as scripts wrap the model whatever the device count (on the
    CPU, or one GPU, it calls the module): hooks on the wrapper give the module's grad1."""
    model = mlp()
    wrapped = nn.DataParallel(model)
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(wrapped):
        F.cross_entropy(wrapped(x), y).backward()
    assert_grad1(model, want, "")


def test_dataloader_last_batch_smaller_and_of_one():
    """A ``DataLoader`` without ``drop_last``: 9 examples in batches of 4, 4 and 1, a
    ``zero_grad`` before each: every batch's grad1 has its own size and values."""
    from torch.utils.data import DataLoader, TensorDataset

    model = mlp()
    x, y = batch(0, n=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []
    with gradhooks.add_hooks(model):
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=4):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, xb, yb), f"batch of {len(xb)}")
            sizes.append(model[0].weight.grad1.shape[0])
            opt.step()
    assert sizes == [4, 4, 1]


# -- misuse: a clear error, or the documented behaviour -------------------------------------------


def test_hooking_a_child_of_a_hooked_model_is_refused():
    """``add_hooks(model)`` then ``add_hooks(model.encoder)`` (a second handle for a part):
    every gradient would be counted twice; refused, naming the module, the model unchanged."""
    model = mlp()
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.StateError, match="already hooked"):
            gradhooks.add_hooks(model[0])
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), "after the refusal")


def test_two_batches_of_different_sizes_in_one_loss_are_refused():
    """Two forwards of batches of different sizes (two datasets in one step) summed into one
    loss: no row of grad1 is one example's; refused with an error naming the sizes, and no
    grad1 of the step is left to be read."""
    model = mlp()
    (xa, ya), (xb, yb) = batch(0, n=4), batch(1, n=6)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(xa), ya) + F.cross_entropy(model(xb), yb)
        with pytest.raises(gradhooks.StateError, match=r"\(6, .*\(4, |\(4, .*\(6, ") as e:
            loss.backward()
        assert "concatenate them into one forward" in str(e.value)
        assert not any(hasattr(p, "grad1") or p.grad is not None for p in model.parameters())


def test_hooks_removed_between_the_forward_and_the_backward():
    """``remove()`` while a backward is pending: the backward runs as without gradhooks and
    writes nothing; grad1 stays what the last captured backward wrote (as ``.grad`` stays
    after the hooks go) until ``clear_grad1``."""
    model = mlp()
    x, y = batch(0)
    h = gradhooks.add_hooks(model)
    F.cross_entropy(model(x), y).backward()
    before = grads_of(model)
    model.zero_grad()
    loss = F.cross_entropy(model(batch(1)[0]), batch(1)[1])
    h.remove()
    loss.backward()
    assert_grad1(model, before, "untouched")
    gradhooks.clear_grad1(model)
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_a_summed_loss_under_the_default_mean_is_told_by_check_and_rescaled():
    """The commonest misuse: ``reduction="sum"`` with ``add_hooks``' default
    ``loss_reduction="mean"`` (grad1 ``batch`` times too large, which nothing can see without
    the loss). ``h.check(loss_fn, x, y)`` says so, ``h.rescale("sum")`` mends it."""
    model = mlp()
    x, y = batch(0)
    ce_sum = lambda out, y: F.cross_entropy(out, y, reduction="sum")  # noqa: E731
    want = loop_grad(model, ce_sum, x, y)
    with gradhooks.add_hooks(model) as h:
        ce_sum(model(x), y).backward()
        report = h.check(ce_sum, x, y, raise_on_error=False)
        assert not report.ok and "sum" in str(report)
        h.rescale("sum")
        assert_grad1(model, want, "rescaled")
        assert h.check(ce_sum, x, y, raise_on_error=False).ok


@pytest.mark.parametrize("how", ["class-weights", "ignore-index"])
def test_a_loss_that_is_not_a_mean_over_examples_is_told_by_check(how):
    """Class-weighted cross-entropy (the mean divides by the batch's total weight) and token
    labels with ``ignore_index=-100`` (the mean over the batch's labelled tokens): neither is
    a mean of per-example losses, so grad1 is each example's share of the batch's gradient,
    not its own; ``h.check`` with the loss says so instead of passing."""
    torch.manual_seed(0)
    if how == "class-weights":
        model = mlp()
        x, y = batch(0)
        w = torch.tensor([1.0, 4.0], dtype=D)
        loss = lambda out, y: F.cross_entropy(out, y, weight=w)  # noqa: E731
    else:
        model = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7)).to(D)
        x = torch.randint(7, (3, 5), generator=torch.Generator().manual_seed(0))
        y = x.clone()
        y[0, 2:] = -100
        loss = lambda out, y: F.cross_entropy(out.reshape(-1, 7), y.reshape(-1))  # noqa: E731
    with gradhooks.add_hooks(model) as h:
        loss(model(x), y).backward()
        report = h.check(loss, x, y, raise_on_error=False)
    assert not report.ok and "not their own gradient" in str(report)


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_a_module_backward_hook_that_changes_the_gradient_otherwise_is_refused(kind):
    """Gradient centring written as a module hook (``register_full_backward_hook`` returning
    ``grad_input - grad_input.mean(0)``, or the pre-hook on ``grad_output``): every example's
    gradient then depends on the others', and no per-example gradient gives the ``.grad``
    it makes. No check of gradhooks' own runs through a module's hooks (they fire once per
    backward); refused where the hook runs, naming the module, as a parameter hook that does
    so is."""
    model = mlp()
    centre = lambda g: g - g.mean(0, keepdim=True)  # noqa: E731
    if kind == "full":
        model[2].register_full_backward_hook(lambda m, gi, go: (centre(gi[0]),))
    else:
        model[2].register_full_backward_pre_hook(lambda m, go: (centre(go[0]),))
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match="'2' \\(Linear\\).*by a factor"):
            F.cross_entropy(model(x), y).backward()


def test_a_module_backward_hook_that_reverses_the_gradient_is_followed():
    """A gradient reversal written as a module hook (``-0.3 * grad_input``): a factor, which
    the per-example gradients follow; the hook fires once per backward, as without
    gradhooks."""
    model = mlp()
    fired = []

    def reverse(m, gi, go):
        fired.append(1)
        return (-0.3 * gi[0],)

    model[2].register_full_backward_hook(reverse)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)  # (the loop's backwards fire it too)
            fired.clear()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert fired == [1]
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- more of the loops' idioms ---------------------------------------------------------------------


def test_hf_gradient_checkpointing_non_reentrant():
    """``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False})`` on a BERT classifier, as memory-bound fine-tuning scripts turn it on: the layers
    run again at the backward; grad1 counts each call once."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
        vocab_size=20, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).to(D)
    with warnings.catch_warnings():  # (renamed activation_checkpointing_enable in 5.x)
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(1, 20, (3, 5), generator=g), torch.randint(3, (3,), generator=g)
    params = list(model.parameters())
    rows = [torch.autograd.grad(model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss,
                                params, allow_unused=True) for i in range(3)]  # fmt: skip
    want = {n: torch.stack([r[k] if r[k] is not None else torch.zeros_like(p) for r in rows])
            for k, (n, p) in enumerate(model.named_parameters())}  # fmt: skip
    with gradhooks.add_hooks(model):
        model(input_ids=ids, labels=labels).loss.backward()
        assert_grad1(model, want, "")


def test_wgan_gp_critic_loss_is_refused_pointing_to_torch_func():
    """WGAN-GP's critic loss holds the gradient penalty, built from the input-gradient taken
    with ``create_graph=True``: its per-example gradients have terms hooks cannot see;
    refused, naming the layer, ``h.paused()`` and ``torch.func``, with no grad1 written."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).to(D)
    real, fake = batch(0)[0], batch(1)[0]
    with gradhooks.add_hooks(critic):
        eps = torch.rand(4, 1, dtype=D)
        mixed = (eps * real + (1 - eps) * fake).requires_grad_()
        (g,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        loss = critic(fake).mean() - critic(real).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()
        with pytest.raises(gradhooks.UnsupportedError, match=r"create_graph=True.*torch\.func"):
            loss.backward()
    assert not any(hasattr(p, "grad1") for p in critic.parameters())


def test_gradual_unfreezing_with_param_groups_added():
    """ULMFiT's gradual unfreezing: only the head trains at first; each epoch one more layer
    gets ``requires_grad_(True)`` and joins the optimizer through ``add_param_group`` with its
    own learning rate. Each epoch's grad1 is on the trainable parameters alone, and right."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))
    model = model.to(D).requires_grad_(False)
    model[4].requires_grad_(True)
    opt = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for epoch, layer in enumerate([None, 2, 0]):
            if layer is not None:
                model[layer].requires_grad_(True)
                opt.add_param_group({"params": list(model[layer].parameters()), "lr": 0.01})
            x, y = batch(epoch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"epoch {epoch}")
            assert all(hasattr(p, "grad1") == p.requires_grad for p in model.parameters())
            opt.step()


def test_bfloat16_parameters_set_after_add_hooks():
    """``model.to(torch.bfloat16)`` after ``add_hooks`` (pure bfloat16 training): grad1 in
    bfloat16, against the float64 loop at the same (bfloat16-rounded) weights and inputs.
    Each entry is a few bfloat16 roundings (2^-8 each) off: seen 5e-3 of the largest
    entry; tolerance 3e-2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    ref = copy.deepcopy(model).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        model.to(torch.bfloat16)
        for step in range(2):
            x, y = batch(step)
            x = x.to(torch.bfloat16)
            opt.zero_grad()
            F.cross_entropy(model(x).float(), y).backward()
            for q, p in zip(ref.parameters(), model.parameters()):
                q.data.copy_(p.data)
            want = loop_grad(ref, F.cross_entropy, x.to(D), y)
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.bfloat16, n
                err = (p.grad1.double() - want[n]).abs().max() / want[n].abs().max()
                assert err < 3e-2, f"step {step}: {n} off by {err:.2e}"
            opt.step()


class Recurrent(nn.Module):
    """An RNN cell written with a Linear on ``[x, h]`` and an output Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell, self.out = nn.Linear(7, 4), nn.Linear(4, 2)

    def forward(self, x, h):
        h = torch.tanh(self.cell(torch.cat([x, h], 1)))
        return self.out(h), h


def test_truncated_bptt_without_detach_and_retain_graph():
    """The hidden state carried without ``detach`` and ``loss.backward(retain_graph=True)``
    (what a script that forgot ``repackage_hidden`` does to silence autograd's error): each
    backward goes through every earlier chunk; grad1 after ``zero_grad`` is each sequence's
    gradient of the chunk's loss through the whole history."""
    model = Recurrent().to(D)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 3, generator=g, dtype=D) for _ in range(3)]
    ys = [torch.randint(2, (3,), generator=g) for _ in range(3)]
    params = list(model.parameters())

    def own(k: int) -> dict:
        rows = []
        for i in range(3):
            h = torch.zeros(1, 4, dtype=D)
            for j in range(k + 1):
                out, h = model(xs[j][i : i + 1], h)
            rows.append(torch.autograd.grad(F.cross_entropy(out, ys[k][i : i + 1]), params))
        return {
            n: torch.stack([r[q] for r in rows])
            for q, (n, _) in enumerate(model.named_parameters())
        }

    with gradhooks.add_hooks(model) as h_:
        h = torch.zeros(3, 4, dtype=D)
        for k in range(3):
            with h_.paused():
                want = own(k)
            model.zero_grad()
            out, h = model(xs[k], h)
            F.cross_entropy(out, ys[k]).backward(retain_graph=True)
            assert_grad1(model, want, f"chunk {k}")


def test_a_backward_run_inside_the_forward():
    """A forward that backpropagates an auxiliary loss itself before returning (``retain_graph``;
    the backward starts before the forward ends): grad1 after the outer backward holds each
    example's gradient of both."""

    class Aux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = self.a(x)
            (0.1 * h.pow(2).sum(1).mean()).backward(retain_graph=True)
            return self.b(torch.tanh(h))

    model = Aux().to(D)
    x, y = batch(0)
    rows = []
    for i in range(4):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append([p.grad.clone() for p in model.parameters()])
    want = {
        n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(model.named_parameters())
    }
    model.zero_grad()
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, "")


def test_zero_grad_between_the_forward_and_the_backward():
    """The tutorials' other order: forward, loss, ``optimizer.zero_grad()``, backward, step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss.backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()


def test_label_smoothing_times_a_loss_scale_and_a_gradient_scaling_hook():
    """``F.cross_entropy(..., label_smoothing=0.1) * loss_scale`` and a hook scaling one
    layer's gradient (a per-layer learning-rate trick, ``p.register_hook(lambda g: 0.1 *
    g)``): both scale grad1 as they scale ``.grad``."""
    model = mlp()
    for p in model[0].parameters():
        p.register_hook(lambda g: 0.1 * g)
    smoothed = lambda out, y: 8.0 * F.cross_entropy(out, y, label_smoothing=0.1)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, smoothed, x, y)  # (the loop's backwards run the hook too)
            opt.zero_grad()
            smoothed(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_an_empty_batch_after_filtering():
    """Every example filtered out (``x[keep]`` with no ``keep``), a summed loss of 0: grad1
    has no rows, and the next batch is as ever."""
    model = mlp()
    x, y = batch(0)
    keep = y > 5
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x[keep]), y[keep], reduction="sum").backward()
        assert all(p.grad1.shape == (0, *p.shape) for p in model.parameters())
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), "next batch")


def test_grad1_read_before_any_backward_is_an_attribute_error():
    model = mlp()
    with gradhooks.add_hooks(model):
        model(batch(0)[0])
        with pytest.raises(AttributeError, match="grad1"):
            model[0].weight.grad1  # noqa: B018


def test_torchvision_reference_loop_with_an_averaged_model_ema():
    """torchvision's classification reference: ``ExponentialMovingAverage``, an
    ``AveragedModel`` (a deep copy of the hooked model, not hooked) updated by
    ``update_parameters`` every step, evaluated under ``inference_mode``; the training steps'
    grad1 is unaffected, and the averaged copy never gets one."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = SmallConvNet().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model) as h:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        for step in range(3):
            x = torch.randn(4, 3, 6, 6, generator=g, dtype=D)
            y = torch.randint(5, (4,), generator=g)
            ce = lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)  # noqa: E731
            want = loop_grad(model, ce, x, y)
            opt.zero_grad()
            ce(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            ema.update_parameters(model)
            with torch.inference_mode():
                ema.eval()
                ema(x[:2]).argmax(1)
        assert h.accumulated == 1
    assert not any(hasattr(p, "grad1") for p in ema.parameters())


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("source", ["another-model", "detached-output"])
def test_dp_step_on_losses_that_do_not_reach_the_hooked_model_is_refused(source, quantity):
    """DP losses computed from the wrong tensor: from another model (the EMA copy, the
    teacher) or from the hooked model's output detached and made to require grad again.
    The backward reaches no hooked parameter: the step would be noise alone, with the norms
    all 0. Refused, with nothing written; an empty batch (a Poisson draw) is still a step."""
    model, other = mlp(), mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        out = model(x)
        if source == "another-model":
            losses = F.cross_entropy(other(x), y, reduction="none")
        else:
            losses = F.cross_entropy(out.detach().requires_grad_(), y, reduction="none")
        with pytest.raises(gradhooks.StateError, match="does not depend on any trainable"):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0)
        assert all(p.grad is None for p in model.parameters())
        empty = F.cross_entropy(model(x[:0]), y[:0], reduction="none")
        norms = gradhooks.dp_sgd_step(h, empty, max_norm=1.0, noise_multiplier=1.0,
                                      expected_batch_size=4.0)  # fmt: skip
        assert norms.shape == (0,) and all(p.grad is not None for p in model.parameters())


def test_optimizer_step_fused_into_the_backward_over_steps():
    """The PyTorch tutorial's memory-saving loop: one optimizer per parameter, stepped and
    zeroed by a ``register_post_accumulate_grad_hook`` inside the backward; the loop itself
    calls neither ``step`` nor ``zero_grad``. Each step's grad1 is its own (at the weights
    its forward ran at), and the parameters follow the same loop run without gradhooks."""
    model = mlp()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in m.parameters()}

        def hook(p, opts=opts):
            opts[p].step()
            opts[p].zero_grad()

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    plain = mlp()  # (the oracle's own copy: no hook steps it during the loop's backwards)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            plain.load_state_dict(model.state_dict())
            want = loop_grad(plain, F.cross_entropy, x, y)
            for m in (model, twin):
                F.cross_entropy(m(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            assert_same(model, twin, f"step {step}")


# -- quantization-aware training, and batch statistics the tracker cannot follow ------------------


class QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.quant, self.dequant = (
            torch.ao.quantization.QuantStub(),
            torch.ao.quantization.DeQuantStub(),
        )
        self.l1, self.relu, self.l2 = nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)

    def forward(self, x):
        return self.dequant(self.l2(self.relu(self.l1(self.quant(x)))))


def _qat_model(observers: bool):
    model = QATNet()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao.quantization's deprecation notices)
        torch.ao.quantization.prepare_qat(model, inplace=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # calibration
        model(torch.randn(16, 3, generator=g))
    if not observers:
        model.apply(torch.ao.quantization.disable_observer)
    return model


def test_quantization_aware_training_with_the_observers_frozen():
    """The QAT tutorial's later epochs: ``prepare_qat``, a few calibrating batches, then
    ``model.apply(torch.ao.quantization.disable_observer)``: every fake-quantized call runs
    with fixed scales, and grad1 is each example's own (float32, exact: the same rounding
    grid on both sides)."""
    model = _qat_model(observers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", rtol=1e-5, atol=1e-6)
            opt.step()


def test_quantization_aware_training_with_observers_on_is_refused():
    """QAT's first epochs: ``FakeQuantize`` (``fused_moving_avg_obs_fake_quant``) updates its
    range from the batch's min and max before quantizing with it, so every example's output
    depends on the others (not differentiably: the run-time check cannot see it). Refused,
    naming the operation; nothing written."""
    model = _qat_model(observers=True)
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match="fused_moving_avg_obs_fake_quant"):
            F.cross_entropy(model(x.float()), y).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


class MaxScaled(nn.Module):
    """``h / float(h.abs().max())`` before a layer (``how="scale"``: the batch's largest
    activation read into Python and used), or read and only logged (``"log"``), or the count
    of the batch's entries read and used (``"count"``, a whole number: what is read to trim
    padding or divide a loss by); an int: ``h`` divided by it."""

    def __init__(self, how="scale") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how, self.read = how, []
        self.l1, self.l2 = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = self.l1(x)
        if self.how == "scale":
            h = h / float(h.detach().abs().max())
        elif self.how == "log":
            self.read.append(float(h.detach().abs().max()))
        elif self.how == "count":
            h = h / float(torch.ones_like(h).sum()) * 5
        elif isinstance(self.how, int):  # (a divisor given)
            h = h / self.how
        return self.l2(torch.tanh(h))


@pytest.mark.parametrize("verify", [True, False])
def test_a_batch_statistic_read_into_python_and_used_in_the_forward_is_refused(verify):
    """``float(h.abs().max())`` leaves the tracker as a Python number; given back to an
    operation (``h / s``: the same double), what it computes depends on every example, and the
    layer after it is refused, naming it. Before, the layer's grad1 was written in silence (the
    run-time check's gradients are of the same forward, and agree)."""
    model = MaxScaled().to(D)
    x, y = batch(0)
    with gradhooks.add_hooks(model, verify=verify):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'l2'.*read into Python"):
            F.cross_entropy(model(x), y).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("how", ["log", "count"])
def test_a_batch_statistic_read_and_logged_or_a_count_matches_the_loop(how):
    """The same statistic read and only logged, or a whole number read and used (the batch's
    count of entries, as a padding length or a loss's divisor is read): not refused; grad1 is
    the loop's (the count is the batch's in the loop too: scaled back by the batch size)."""
    model = MaxScaled(how).to(D)
    x, y = batch(0)
    # (the count is the batch's: the loop's forward divides by it as a constant)
    same = MaxScaled("log" if how == "log" else x.shape[0]).to(D)
    want = loop_grad(same, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, how)
    assert model.read or how == "count"


def test_a_module_backward_hook_that_clamps_the_gradient_in_place_is_refused():
    """A hook that returns nothing but clamps the gradient it is given in place
    (``grad_input[0].clamp_(-c, c)``): a change all the same, refused."""
    model = mlp()

    def clamp(m, grad_input, grad_output):
        grad_input[0].clamp_(-1e-3, 1e-3)

    model[2].register_full_backward_hook(clamp)
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match="by a factor"):
            F.cross_entropy(model(x), y).backward()


class MatrixExp(nn.Module):
    """A layer without a rule (its per-example gradients by the ``torch.func`` fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(0.3 * torch.randn(3, 3, generator=torch.Generator().manual_seed(4)))

    def forward(self, x):
        return x @ torch.matrix_exp(self.w)


def test_backward_hooks_on_a_module_the_fallback_recomputes_fire_once():
    """A module without a rule that holds a user's full backward hooks (one that counts, one
    that scales the gradient it passes on): the fallback recomputes it per example, and its
    recomputation's backward must not fire them again (a hook given a ``grad_input`` of
    ``None`` there failed, blamed on the fallback); grad1 is the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), MatrixExp(), nn.Tanh(), nn.Linear(3, 2)).to(D)
    fired = []
    model[1].register_full_backward_hook(lambda m, gi, go: fired.append(1))
    model[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    fired.clear()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        assert [n for n, _ in h.fallback_modules()] == ["1"]
    assert fired == [1]
    assert_grad1(model, want, "")

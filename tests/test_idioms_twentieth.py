"""Training-loop idioms, a twentieth set: the training loops of more real, widely used scripts.

Each test writes again, with a tiny model and in gradhooks' terms, the loop of a script read on
GitHub (its repository and path in the docstring): facebookresearch's schedule-free SGD (the
weights moved between the average and the gradient point by ``optimizer.train()`` and
``optimizer.eval()``); facebookresearch/mae's pre-training (patches masked by a per-example
random shuffle drawn inside the forward, the mask token tiled along the batch and the sequence,
the loss inside the model, ``NativeScaler`` in float16; and transformers' ``ViTMAE``, called as
is); luyug/GradCache (a contrastive loss over a batch run again chunk by chunk, each chunk's
surrogate backward with the cached representation gradients); allenai/OLMo's micro-batches over
the whole batch's token count with the z-loss, in bfloat16 and through the DP optimizer;
diffusers' DreamBooth (prior preservation: the instance and class halves of one batch weighted
apart, the text encoder trained beside the UNet); openai/improved-diffusion (the hybrid loss
whose bound reaches only the learned variance, timesteps drawn by importance and weighted back);
transformers' ``run_swag_no_trainer`` (the choices folded into the batch inside the model,
accelerate's accumulation and bfloat16) and ``run_qa_no_trainer`` (start and end losses averaged
over the answers inside the window); facebookresearch/dino (the backbone run once per crop
resolution, the head on all crops); trl's GRPO (group-relative advantages, a per-token KL to a
frozen reference); stable-baselines3's SAC (the entropy coefficient's, the critic's and the
actor's backwards of one replay sample); facebookresearch/deit (a distillation token, a teacher
inside the criterion, hard and soft); transformers' NEFTune hook on a PEFT model; PEFT's
trainable token rows beside LoRA in a tied GPT-2; torchtune's full fine-tune (layers compiled in
place, AdamW stepped in the backward); CycleGAN (each generator called three times a step, the
discriminators frozen in turn, fakes from an image pool).

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in float64 or within the rounding of
the precision the script runs in."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_eighteenth import BF16, assert_near, clipped, norms_of, relative_error
from test_idioms_fifth import accelerate as accelerate_state  # noqa: F401 (a fixture)
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    assert_untouched,
    hf,
    labelled_batch,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    tiny_bert_config,
    wide_mlp,
)

D = torch.float64
STEPS = 3
FP16 = 1e-2  # float16: 11 bits, a few roundings deep, of the largest entry
F32 = 1e-5  # float32: 24 bits, a few roundings deep, of the largest entry


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


def assert_within(model: nn.Module, want: dict, tol: float, what: str, scale: float = 1.0):
    """Every trainable parameter's ``grad1 / scale`` within ``tol`` of ``want``'s largest
    entry (the rounding of the precision the loop runs in)."""
    checked = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            err = relative_error(p.grad1 / scale, want[n])
            assert err < tol, f"{what}: {n} off by {err:.2e}"
            checked += 1
    assert checked, what


def assert_step(model: nn.Module, h, want: dict, norms: torch.Tensor, bf16: bool, what: str):
    """A step's ``grad1`` and norms against the float64 loop's (``want``, ``norms``): within
    bf16's rounding of the largest entry under autocast, else to float64's."""
    if bf16:
        assert_within(model, want, BF16, what)
        err = relative_error(h.norms(), norms)
        assert err < BF16, f"{what}: norms off by {err:.2e}"
    else:
        assert_grad1(model, want, what)
        assert_close(h.norms(), norms, f"{what}: norms")


# -- facebookresearch/schedule_free: SGDScheduleFree's train() and eval() ------------------------


class ScheduleFreeSGD(torch.optim.Optimizer):
    """facebookresearch/schedule_free ``schedulefree/sgd_schedulefree.py``'s
    ``SGDScheduleFree`` (its per-parameter path, no warm-up, ``r=0``): the parameters hold
    ``y``, the point where the gradient is taken, between the SGD iterate ``z`` (in the state)
    and the average ``x``; ``eval()`` moves them to ``x`` and ``train()`` back to ``y``, each
    by ``p.data.lerp_``; ``step`` raises outside train mode."""

    def __init__(self, params, lr: float = 0.5, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum, k=0, train_mode=True,
                                      weight_sum=0.0, lr_max=-1.0))  # fmt: skip

    def _move(self, to_train: bool, weight) -> None:
        for group in self.param_groups:
            if group["train_mode"] != to_train:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.data.lerp_(end=self.state[p]["z"], weight=weight(group["momentum"]))
                group["train_mode"] = to_train

    def eval(self) -> None:
        self._move(False, lambda momentum: 1 - 1 / momentum)

    def train(self) -> None:
        self._move(True, lambda momentum: 1 - momentum)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["train_mode"]:
                raise RuntimeError("Not in train mode!")
            lr, momentum, k = group["lr"], group["momentum"], group["k"]
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = lr_max**2
            group["weight_sum"] += weight
            ckp1 = weight / group["weight_sum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                z = self.state[p].setdefault("z", p.data.clone())
                p.data.lerp_(end=z, weight=ckp1)
                p.data.add_(p.grad, alpha=lr * (momentum * (1 - ckp1) - 1))
                z.sub_(p.grad, alpha=lr)
            group["k"] = k + 1


@pytest.mark.parametrize("how", ["grad1 and norms", "bf16 autocast", "dp_sgd_step"])
def test_schedule_free_sgd_gradients_taken_at_y_between_train_and_eval(how):
    """facebookresearch/schedule_free's README loop (``optimizer.train()`` before the training
    steps, ``optimizer.eval()`` before evaluating) over ``schedulefree/sgd_schedulefree.py``:
    the optimizer, not the loop, writes the weights between the steps, by ``p.data.lerp_`` to
    ``y`` (where the gradient is taken) and, for the evaluation after the second step, to
    ``x`` and back. At each of three steps grad1 and the norms are the float64 loop's of each
    example's cross-entropy at the weights the step runs at (``y``): exactly in float64, within
    bfloat16's rounding of each parameter's largest entry under bfloat16 autocast;
    ``dp_sgd_step`` (no noise) writes the loop's clipped mean into ``.grad`` for the
    schedule-free step. The evaluation under ``no_grad`` in eval mode writes nothing, and the
    weights it runs at are not the training ones."""
    bf16 = how == "bf16 autocast"
    model = wide_mlp(out=3).to(torch.float32 if bf16 else D)
    opt = ScheduleFreeSGD(model.parameters())
    quantities = ("grad1",) if how == "dp_sgd_step" else ("grad1", "norms")
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt.train()
        model.train()
        for step in range(STEPS):
            x, y = labelled_batch(step, n=6, classes=3)
            want = loop_grad(reference(model), lambda o, t: F.cross_entropy(o, t), x, y)
            opt.zero_grad(set_to_none=True)
            if how == "dp_sgd_step":
                losses = F.cross_entropy(model(x), y, reduction="none")
                gradhooks.dp_sgd_step(h, losses, max_norm=0.3, noise_multiplier=0.0)
                assert_grad1(model, want, f"step {step}")
                for n, p in model.named_parameters():
                    assert_close(p.grad, clipped(want, 0.3)[n], f"step {step}: .grad of {n}")
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = F.cross_entropy(model(x.to(model[0].weight.dtype)), y)
                loss.backward()
                assert_step(model, h, want, norms_of(want), bf16, f"step {step}")
            opt.step()
            if step == 1:
                y_point = [p.detach().clone() for p in model.parameters()]
                opt.eval()
                model.eval()
                with torch.no_grad():
                    model(x.to(model[0].weight.dtype))
                assert any(not torch.equal(a, p) for a, p in zip(y_point, model.parameters()))
                opt.train()
                model.train()
                for a, p in zip(y_point, model.parameters()):
                    torch.testing.assert_close(p, a)  # (back at y, to rounding)


# -- facebookresearch/mae: masked autoencoder pre-training ----------------------------------------


class MaeBlock(nn.Module):
    """A pre-norm ViT block (timm's ``Block``, as MAE builds its encoder and decoder): attention
    by one ``qkv`` Linear and ``scaled_dot_product_attention``, then a GELU MLP, each
    residual."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class MaskedAutoencoder(nn.Module):
    """facebookresearch/mae ``models_mae.py``'s ``MaskedAutoencoderViT``, shrunk: 8x8 images in
    4x4 patches (``PatchEmbed``, a strided ``Conv2d``), fixed position tables (parameters that
    do not require grad), ``random_masking`` by an ``argsort`` of per-example noise drawn in
    the forward (``torch.rand(N, L)``, or the ``noise`` given, as Hugging Face's ``ViTMAE``
    takes it) and ``torch.gather`` of the kept patches, the ``cls_token`` expanded to the batch,
    ``mask_token`` repeated to the batch and gathered back into place, one encoder and one
    decoder block; ``forward`` returns ``(loss, pred, mask)``, the loss ``norm_pix_loss``'s
    mean over the removed patches (``(loss * mask).sum() / mask.sum()``)."""

    def __init__(self, dim: int = 8, decoder_dim: int = 6, mask_ratio: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p, self.L, self.mask_ratio = 4, 4, mask_ratio
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + self.L, dim) * 0.1, requires_grad=False)
        self.blocks = nn.ModuleList([MaeBlock(dim)])
        self.norm = nn.LayerNorm(dim)
        self.decoder_embed = nn.Linear(dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, decoder_dim) * 0.02)
        self.decoder_pos_embed = nn.Parameter(
            torch.randn(1, 1 + self.L, decoder_dim) * 0.1, requires_grad=False
        )
        self.decoder_blocks = nn.ModuleList([MaeBlock(decoder_dim)])
        self.decoder_norm = nn.LayerNorm(decoder_dim)
        self.decoder_pred = nn.Linear(decoder_dim, self.p**2 * 3)

    def patchify(self, imgs):
        p, h = self.p, imgs.shape[2] // self.p
        x = imgs.reshape(imgs.shape[0], 3, h, p, h, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(imgs.shape[0], h * h, p * p * 3)

    def random_masking(self, x, noise):
        N, L, D = x.shape
        len_keep = int(L * (1 - self.mask_ratio))
        noise = torch.rand(N, L, device=x.device) if noise is None else noise
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        return x_masked, torch.gather(mask, dim=1, index=ids_restore), ids_restore

    def forward(self, imgs, noise=None):
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2)
        x = x + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, noise)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat((cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]
        target = self.patchify(imgs)
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        loss = (loss * mask).sum() / mask.sum()
        return loss, pred, mask


@pytest.mark.parametrize("fp16", [False, True], ids=["float64", "fp16 NativeScaler"])
def test_mae_pretraining_random_masking_drawn_in_the_forward_with_accumulation(fp16):
    """facebookresearch/mae ``engine_pretrain.py`` (``train_one_epoch``) over ``models_mae.py``:
    ``loss, _, _ = model(samples, mask_ratio=...)`` under ``torch.cuda.amp.autocast()``, the
    loss inside the model; ``loss /= accum_iter`` (2); ``loss_scaler(loss, optimizer,
    parameters=model.parameters(), update_grad=(data_iter_step + 1) % accum_iter == 0)``
    (``util/misc.py``'s ``NativeScalerWithGradNormCount``: ``scale(loss).backward()``, then on
    an update ``unscale_`` and the gradient norm, ``step``, ``update``); ``zero_grad`` after an
    update; ``lr_sched.adjust_learning_rate`` at each step's first micro-batch; AdamW over
    ``param_groups_weight_decay`` (no decay for biases, norms and tokens). Each example's
    patches are masked by its own random shuffle, drawn inside the forward (the loop is given
    the same draws). At every micro-batch grad1 (summed over the step's micro-batches, as
    ``.grad``) is the float64 loop's of each image's mean over its removed patches: exactly in
    float64, and, of the scaled loss, within float16's rounding under float16 autocast with
    ``GradScaler("cpu")``. The frozen position tables have no grad1."""
    dtype = torch.float32 if fp16 else D
    model = MaskedAutoencoder().to(dtype)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2
             and "token" not in n]  # fmt: skip
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not
                (p.ndim >= 2 and "token" not in n)]  # fmt: skip
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95),
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    accum_iter, g, want = 2, torch.Generator().manual_seed(0), {}
    with gradhooks.add_hooks(model):
        for it in range(2 * STEPS):
            if it % accum_iter == 0:
                for group in opt.param_groups:
                    group["lr"] = 1e-2 * min(1.0, (it / accum_iter + 1) / 2)
            samples = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
            torch.manual_seed(100 + it)
            noise = torch.rand(4, 4)
            mine = loop_grad(reference(model), lambda out: out[0] / accum_iter, (samples, noise))
            want = mine if it % accum_iter == 0 else {n: want[n] + mine[n] for n in mine}
            torch.manual_seed(100 + it)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss, _, _ = model(samples.to(dtype))
            loss /= accum_iter
            scale = scaler.get_scale() if fp16 else 1.0
            scaler.scale(loss).backward()
            if fp16:
                assert_within(model, want, FP16, f"micro-batch {it}", scale=scale)
            else:
                assert_grad1(model, want, f"micro-batch {it}", frozen_clean=True)
            assert not hasattr(model.pos_embed, "grad1")
            if (it + 1) % accum_iter == 0:
                scaler.unscale_(opt)
                norm = torch.cat([p.grad.flatten() for p in model.parameters()
                                  if p.grad is not None]).norm()  # fmt: skip
                step_norm = torch.cat([w.mean(0).flatten() for w in want.values()]).norm()
                err = relative_error(norm, step_norm)
                assert err < (FP16 if fp16 else 1e-10), f"step {it // 2}: the norm off by {err:.2e}"
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()


class RepeatedPrompt(nn.Module):
    """A learned prompt of two tokens, ``[1, 2, dim]``, tiled over the batch and twice along
    the sequence (``repeat(batch, 2, 1)``), then concatenated in front of the patches'
    embeddings (``how="cat"``) or multiplying them (``how="mul"``), and the loss inside the
    module, as MAE puts it: a tile of more than one row."""

    def __init__(self, how: str, dim: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.embed, self.head = nn.Linear(3, dim), nn.Linear(dim, 3)
        self.prompt = nn.Parameter(torch.randn(1, 2, dim))

    def forward(self, x):
        h = self.embed(x)
        tiled = self.prompt.repeat(x.shape[0], 2, 1)
        h = torch.cat([tiled, h], dim=1) if self.how == "cat" else h * tiled
        h = torch.tanh(h) * torch.linspace(0.5, 1.5, h.shape[1], dtype=h.dtype)[:, None]
        return (self.head(h.mean(1)) - x.mean(1)).pow(2).sum(-1).mean()


@pytest.mark.parametrize("how", ["cat", "mul"])
def test_a_parameter_tiled_along_the_sequence_and_the_batch_with_the_loss_inside(how):
    """A parameter tiled by ``repeat`` along the batch and along another dimension (MAE's
    ``mask_token.repeat(N, masked, 1)``, here a two-token prompt repeated twice), then
    concatenated with the batch or multiplied into it, in a module whose forward returns the
    loss: grad1 is the float64 loop's at each of three SGD steps (each tile's gradient summed
    into the prompt)."""
    model = RepeatedPrompt(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(step), dtype=D)
            want = loop_grad(reference(model), lambda out: out, x)
            opt.zero_grad()
            model(x).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class PixelValues(nn.Module):
    """``model(pixel_values=..., noise=...).loss``, for the loop."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values, noise):
        return self.model(pixel_values=pixel_values, noise=noise).loss


def test_transformers_vit_mae_pretraining_its_noise_drawn_inside_and_its_loss_inside():
    """huggingface/transformers ``examples/pytorch/image-pretraining/run_mae.py`` over
    ``models/vit_mae/modeling_vit_mae.py`` (the library's code, called as is): a one-layer
    ``ViTMAEForPreTraining`` with ``norm_pix_loss``, ``outputs = model(pixel_values=...)``
    (the masking noise drawn inside the forward, the mask token repeated along the batch and
    the masked positions by the decoder, the loss computed inside), ``outputs.loss.backward()``,
    AdamW, ``zero_grad``. At each of three steps grad1 of every trainable parameter is the
    float64 loop's of each image's loss, the loop given the same noise; the fixed sin-cos
    position tables have none."""
    config = hf("ViTMAEConfig")(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        image_size=8, patch_size=4, num_channels=3, decoder_hidden_size=8,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=2, decoder_intermediate_size=10,
        mask_ratio=0.5, norm_pix_loss=True, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf("ViTMAEForPreTraining")(config).to(D)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            pixel_values = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
            torch.manual_seed(50 + step)
            noise = torch.rand(4, 4).to(D)  # (drawn as the model draws it: in float32)
            want = loop_grad(PixelValues(reference(model)), lambda out: out, (pixel_values, noise))
            want = {n.removeprefix("model."): w for n, w in want.items()}
            torch.manual_seed(50 + step)
            outputs = model(pixel_values=pixel_values)
            opt.zero_grad()
            outputs.loss.backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()


# -- luyug/GradCache: a contrastive loss over a batch larger than memory, by chunks ----------------


def contrastive_loss(q_reps, p_reps):
    """GradCache's README loss (DPR's): each query's cross-entropy over its dot products with
    every passage of the batch, its own passage the target; the mean over the queries."""
    scores = q_reps @ p_reps.T
    return F.cross_entropy(scores, torch.arange(len(q_reps)))


def encoder(features: int = 5, dim: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 6), nn.Tanh(), nn.Linear(6, dim)).to(D)


@pytest.mark.parametrize("fp16", [False, True], ids=["float64", "fp16"])
def test_gradcache_surrogate_backward_of_each_chunk_with_its_cached_gradients(fp16):
    """luyug/GradCache ``src/grad_cache/grad_cache.py`` (``GradCache.cache_step``): each
    encoder (queries, passages) runs its chunks of 2 under ``no_grad``
    (``forward_no_grad``); ``build_cache`` takes the loss of the whole batch of 4 on the
    representations detached (``r.detach().requires_grad_()``), its backward gives each
    representation's gradient, the cache (scaled by the ``GradScaler`` with ``fp16``); then
    ``forward_backward`` runs each chunk again with gradients and backpropagates the surrogate
    ``torch.dot(reps.float().flatten(), gradient.float().flatten())``; then the optimizer's
    step (``scaler.step``). The loss couples the examples, but the cache fixes each
    example's share: the surrogate is a sum over the chunk's examples of ``<rep_i, G_i>``.
    Reading grad1 after each chunk and clearing it (``Hooks.clear()``, ``.grad`` kept), the
    rows of the chunks put together are, at each of three steps, the float64 loop's of
    ``<rep_i(θ), G_i>`` (exactly in float64; over the scale, within float16's rounding under
    float16 autocast), the norms each chunk's, and their sum is ``.grad``."""
    dtype = torch.float32 if fp16 else D
    models = [encoder(seed=0).to(dtype), encoder(seed=1).to(dtype)]
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=fp16)
    g = torch.Generator().manual_seed(0)
    hooks = [gradhooks.add_hooks(m, quantities=("grad1", "norms"), loss_reduction="sum")
             for m in models]  # fmt: skip
    try:
        for step in range(STEPS):
            inputs = [torch.randn(4, 5, generator=g, dtype=D) for _ in models]
            chunks = [x.split(2) for x in inputs]
            with torch.no_grad(), autocast:
                reps = [torch.cat([m(c.to(dtype)) for c in cs]) for m, cs in zip(models, chunks)]
            reps = [r.float().detach().requires_grad_() for r in reps]
            loss = contrastive_loss(*reps)
            scale = scaler.get_scale() if fp16 else 1.0
            scaler.scale(loss).backward()
            cache = [r.grad for r in reps]
            opt.zero_grad()
            for m, h, x, cs, gc in zip(models, hooks, inputs, chunks, cache):
                want = loop_grad(reference(m), lambda out, t: (out * t).sum(), x,
                                 gc.to(D) / scale)  # fmt: skip
                rows: dict = {n: [] for n, _ in m.named_parameters()}
                norms = []
                for c, grad in zip(cs, gc.split(2)):
                    with autocast:
                        r = m(c.to(dtype))
                    surrogate = torch.dot(r.float().flatten(), grad.float().flatten())
                    surrogate.backward()
                    for n, p in m.named_parameters():
                        rows[n].append(p.grad1 / scale)
                    norms.append(h.norms() / scale)
                    h.clear()
                tol = FP16 if fp16 else 1e-10
                for n, p in m.named_parameters():
                    got = torch.cat(rows[n])
                    err = relative_error(got, want[n])
                    assert err < tol, f"step {step}: {n} off by {err:.2e}"
                    # (to the rows' size: their sum cancels, the rounding is the rows')
                    err = ((got.sum(0) - p.grad.to(D) / scale).abs().max() / got.abs().max()).item()
                    assert err < 4 * tol, f"step {step}: {n}'s rows off .grad by {err:.2e}"
                err = relative_error(torch.cat(norms), norms_of(want))
                assert err < tol, f"step {step}: norms off by {err:.2e}"
            scaler.step(opt)
            scaler.update()
    finally:
        for h in hooks:
            h.remove()


# -- allenai/OLMo: micro-batches over the whole batch's token count, with the z-loss --------------


class OlmoBlock(nn.Module):
    """allenai/OLMo ``olmo/model.py``'s ``OLMoSequentialBlock``, shrunk: the non-parametric
    LayerNorm (``layer_norm_type: default``, no affine weights), a fused ``att_proj``
    (q, k, v), causal ``scaled_dot_product_attention``, ``attn_out``; the SwiGLU MLP
    (``ff_proj`` to twice the hidden size, ``x, gate = x.chunk(2, dim=-1)``, ``F.silu(gate) *
    x``, ``ff_out``); each residual."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.att_proj, self.attn_out = (
            nn.Linear(dim, 3 * dim, bias=False),
            nn.Linear(dim, dim, bias=False),
        )
        self.ff_proj, self.ff_out = (
            nn.Linear(dim, 4 * dim, bias=False),
            nn.Linear(2 * dim, dim, bias=False),
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.att_proj(self.attn_norm(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, T, C))
        h, gate = self.ff_proj(self.ff_norm(x)).chunk(2, dim=-1)
        return x + self.ff_out(F.silu(gate) * h)


class Olmo(nn.Module):
    """OLMo's model with ``weight_tying: true`` (OLMo-1B): ``wte``, one block, the final
    non-parametric LayerNorm, the logits by ``F.linear(x, self.wte.weight)``."""

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.block = nn.Embedding(vocab, dim), OlmoBlock(dim)
        self.ln_f = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, input_ids):
        return F.linear(self.ln_f(self.block(self.wte(input_ids))), self.wte.weight)


def olmo_losses(logits, input_ids, attention_mask, batch_size_in_tokens: int):
    """``Trainer.model_forward`` and ``cross_entropy_loss`` (``olmo/train.py``): labels the
    ids shifted by one, -100 where the attention mask is 0, the summed cross-entropy of
    ``logits[..., :-1, :]`` and the z-loss ``1e-4 * logsumexp(logits)**2`` over the labelled
    tokens, each over the whole batch's ``batch_size_in_tokens``: each sequence's, ``[batch]``."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)[..., 1:]
    logits = logits[..., :-1, :].float()
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
    )
    z_squared = logits.logsumexp(-1).pow(2) * (labels != -100)
    per_token = ce.view(labels.shape) + 1e-4 * z_squared
    return per_token.sum(-1) / batch_size_in_tokens


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16 autocast"])
def test_olmo_micro_batches_over_the_batch_token_count_with_the_z_loss(bf16):
    """allenai/OLMo ``olmo/train.py`` (``Trainer.train_batch``, ``train_micro_batch``,
    ``model_forward``, ``cross_entropy_loss``): a batch of 4 right-padded sequences split
    into micro-batches of 2 (``split_batch``), ``batch_size_in_tokens =
    batch["input_ids"].numel()`` (padding counted), under ``torch.autocast(...,
    dtype=cfg.autocast_precision)`` (bfloat16; the model float32), ``ce_loss / batch_size_in_
    tokens + z_loss / batch_size_in_tokens`` (``softmax_auxiliary_loss``) backpropagated per
    micro-batch; then ``clip_grad_norm_(1.0)`` and AdamW, ``zero_grad(set_to_none=True)``.
    The tied head is ``F.linear`` with the embedding's weight; the layer norms have no
    weights. At each micro-batch of three steps grad1 (summed over the batch's micro-batches,
    as ``.grad``) and each micro-batch's norms are the float64 loop's of each sequence's token
    losses and z-losses over the batch's token count: exactly in float64, within bfloat16's
    rounding under bfloat16 autocast."""
    dtype = torch.float32 if bf16 else D
    model = Olmo().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms"), loss_reduction="sum") as h:
        for step in range(STEPS):
            input_ids = torch.randint(13, (4, 6), generator=g)
            lengths = torch.randint(3, 7, (4,), generator=g)
            attention_mask = (torch.arange(6) < lengths[:, None]).long()
            batch_size_in_tokens = input_ids.numel()
            want: dict = {}
            for mb in range(2):
                ids, mask = input_ids[2 * mb : 2 * mb + 2], attention_mask[2 * mb : 2 * mb + 2]

                def own(logits, m, batch_size_in_tokens=batch_size_in_tokens):
                    ids_i = m[..., 0].long()
                    return olmo_losses(logits, ids_i, m[..., 1], batch_size_in_tokens).sum()

                packed = torch.stack((ids.to(D), mask.to(D)), -1)
                mine = loop_grad(reference(model), own, ids, packed)
                want = {n: want.get(n, 0) + mine[n] for n in mine}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(ids)
                    loss = olmo_losses(logits, ids, mask, batch_size_in_tokens).sum()
                loss.backward()
                assert_step(model, h, want, norms_of(mine), bf16, f"step {step}, micro-batch {mb}")
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)


# -- huggingface/diffusers examples/dreambooth: prior preservation, the text encoder trained -------


class TextEncoder(nn.Module):
    """A CLIP text encoder shrunk: token embeddings, a position table, a Linear and a final
    LayerNorm; ``[batch, tokens, 6]``."""

    def __init__(self, vocab: int = 10, dim: int = 6, length: int = 4) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.token_embedding, self.position_embedding = (
            nn.Embedding(vocab, dim),
            nn.Embedding(length, dim),
        )
        self.fc, self.final_layer_norm = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, input_ids):
        h = self.token_embedding(input_ids) + self.position_embedding(
            torch.arange(input_ids.shape[1])
        )
        return self.final_layer_norm(h + torch.tanh(self.fc(h)))


def timestep_embedding(timesteps, dim: int = 6):
    """diffusers' ``get_timestep_embedding``: sines and cosines of the timesteps."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=D) / half)
    args = timesteps[:, None].to(D) * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class TinyUNet(nn.Module):
    """A ``UNet2DConditionModel`` shrunk to its kinds of layers: ``conv_in``, the timestep's
    sinusoidal embedding through ``time_embedding`` (a Linear) added per channel, a GroupNorm,
    cross-attention of the positions (queries) over the text encoder's states (keys and
    values), ``conv_out``; returns ``(sample,)`` (``return_dict=False``)."""

    def __init__(self, channels: int = 4, dim: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_in, self.conv_out = (
            nn.Conv2d(channels, dim, 3, padding=1),
            nn.Conv2d(dim, channels, 3, padding=1),
        )
        self.time_embedding, self.norm = nn.Linear(dim, dim), nn.GroupNorm(2, dim)
        self.to_q, self.to_k, self.to_v = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
        )

    def forward(self, sample, timesteps, encoder_hidden_states, return_dict=True):
        h = self.conv_in(sample)
        temb = self.time_embedding(timestep_embedding(timesteps).to(h.dtype))
        h = F.silu(self.norm(h + temb[:, :, None, None]))
        B, C, H, W = h.shape
        q = self.to_q(h.flatten(2).transpose(1, 2))
        k, v = self.to_k(encoder_hidden_states), self.to_v(encoder_hidden_states)
        h = h + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, C, H, W)
        return (self.conv_out(h),)


class DreamBoothNets(nn.Module):
    """The two trained networks as one function of a batch, for the loop: the UNet on the
    text encoder's states."""

    def __init__(self, unet, text_encoder) -> None:
        super().__init__()
        self.unet, self.text_encoder = unet, text_encoder

    def forward(self, noisy, timesteps, input_ids):
        return self.unet(noisy, timesteps, self.text_encoder(input_ids), return_dict=False)[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16 mixed"])
def test_dreambooth_prior_preservation_with_the_text_encoder_trained(bf16):
    """huggingface/diffusers ``examples/dreambooth/train_dreambooth.py`` (``main``'s loop,
    ``collate_fn``) with ``--with_prior_preservation --prior_loss_weight 0.5
    --train_text_encoder --offset_noise``: each batch the instance images (one prompt, the
    same ids for all) followed by as many class images (the class prompt); a frozen VAE
    (``weight_dtype``) encodes them under ``no_grad``, times ``scaling_factor``; ``noise =
    torch.randn_like(model_input) + 0.1 * torch.randn(bsz, channels, 1, 1)``; a timestep per
    example, ``noise_scheduler.add_noise``; ``encoder_hidden_states = text_encoder(input_ids)``;
    ``model_pred = unet(noisy_model_input, timesteps, encoder_hidden_states,
    return_dict=False)[0]``; ``model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)``
    (and the target), ``loss = F.mse_loss(model_pred.float(), target.float()) +
    prior_loss_weight * F.mse_loss(model_pred_prior.float(), target_prior.float())``; then
    ``clip_grad_norm_`` over both networks, AdamW, ``zero_grad(set_to_none=args.
    set_grads_to_none)`` (off by default; on in the bfloat16 run). Each network hooked on its
    own (as accelerate prepares both), the loss's two halves weighted differently: at each of
    three steps grad1 of the UNet and of the text encoder is the float64 loop's of each
    example's term (an instance example's squared error over the instance half's size, a class
    example's times 0.5 over the class half's): in float64 within float32's rounding (the
    script takes the squared errors of ``.float()``), and within bfloat16's rounding with
    accelerate's ``mixed_precision="bf16"`` (both networks float32 under bfloat16 autocast,
    the VAE in bfloat16), each of the largest entry of the network's (the keys' bias has no
    gradient: the softmax ignores a shift of every key)."""
    dtype = torch.float32 if bf16 else D
    weight_dtype = torch.bfloat16 if bf16 else D
    unet, text_encoder = TinyUNet().to(dtype), TextEncoder().to(dtype)
    torch.manual_seed(2)
    vae = nn.Conv2d(3, 4, 2, stride=2).to(weight_dtype).requires_grad_(False)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=5e-3)
    betas = torch.linspace(1e-4, 0.02, 10, dtype=D)
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    instance_ids, class_ids = torch.tensor([1, 7, 3, 2]), torch.tensor([1, 3, 2, 0])
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(unet, loss_reduction="sum"), gradhooks.add_hooks(
        text_encoder, loss_reduction="sum"
    ):  # fmt: skip
        for step in range(STEPS):
            pixel_values = torch.randn(4, 3, 4, 4, generator=g, dtype=D)
            input_ids = torch.stack([instance_ids] * 2 + [class_ids] * 2)
            with torch.no_grad():
                model_input = (vae(pixel_values.to(weight_dtype)) * 0.18215).to(D)
            noise = torch.randn(model_input.shape, generator=g, dtype=D)
            noise = noise + 0.1 * torch.randn(4, 4, 1, 1, generator=g, dtype=D)
            timesteps = torch.randint(0, 10, (4,), generator=g)
            a = alphas_cumprod[timesteps][:, None, None, None]
            noisy = a.sqrt() * model_input + (1 - a).sqrt() * noise
            weight = torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=D) / noise[:2].numel()

            def own(pred, t):
                return t[:, -1] * ((pred.flatten(1) - t[:, :-1]) ** 2).sum()

            target = torch.cat([noise.flatten(1), weight[:, None]], 1)
            joined = reference(DreamBoothNets(unet, text_encoder))
            want = loop_grad(joined, own, (noisy, timesteps, input_ids), target)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                encoder_hidden_states = text_encoder(input_ids)
                model_pred = unet(
                    noisy.to(dtype), timesteps, encoder_hidden_states, return_dict=False
                )[0]
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(noise.to(dtype), 2, dim=0)
            loss = F.mse_loss(model_pred.float(), target.float())
            prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float())
            (loss + 0.5 * prior_loss).backward()
            for prefix, net in (("unet.", unet), ("text_encoder.", text_encoder)):
                mine = {n: want[prefix + n] for n, _ in net.named_parameters()}
                got = {n: p.grad1 for n, p in net.named_parameters()}
                assert_near(got, mine, BF16 if bf16 else F32, f"step {step}: {prefix}")
            nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=bf16)


# -- openai/improved-diffusion: the hybrid loss, a learned variance, importance-sampled steps -----


T_STEPS = 4
BETAS = torch.linspace(0.1, 0.4, T_STEPS, dtype=D)


def diffusion_tables():
    """``GaussianDiffusion.__init__``'s tables for ``BETAS``."""
    alphas_cumprod = torch.cumprod(1 - BETAS, 0)
    prev = torch.cat([torch.ones(1, dtype=D), alphas_cumprod[:-1]])
    posterior_variance = BETAS * (1 - prev) / (1 - alphas_cumprod)
    return dict(
        sqrt_ac=alphas_cumprod.sqrt(), sqrt_1mac=(1 - alphas_cumprod).sqrt(),
        sqrt_recip_ac=(1 / alphas_cumprod).sqrt(), sqrt_recipm1_ac=(1 / alphas_cumprod - 1).sqrt(),
        post_log_var=torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]])),
        coef1=BETAS * prev.sqrt() / (1 - alphas_cumprod),
        coef2=(1 - prev) * (1 - BETAS).sqrt() / (1 - alphas_cumprod),
    )  # fmt: skip


def normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))  # fmt: skip


def discretized_gaussian_log_likelihood(x, means, log_scales):
    def cdf(v):
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))

    centered, inv_stdv = x - means, torch.exp(-log_scales)
    cdf_plus, cdf_min = cdf(inv_stdv * (centered + 1 / 255)), cdf(inv_stdv * (centered - 1 / 255))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    mid = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, mid))


def hybrid_losses(model_output, x_start, x_t, noise, t):
    """``GaussianDiffusion.training_losses`` (``improved_diffusion/gaussian_diffusion.py``)
    with ``learn_sigma`` (``LEARNED_RANGE``), ``EPSILON`` and ``RESCALED_MSE``: the output
    split into ε and the variance's interpolation values; ``frozen_out = th.cat([model_output.
    detach(), model_var_values], dim=1)`` for the variational bound (``_vb_terms_bpd``: the KL
    to the posterior, or the decoder's discretized likelihood at ``t == 0``, in bits, times
    ``num_timesteps / 1000``), plus the mean squared error of ε: ``[batch]``."""
    tab = diffusion_tables()

    def at(name):
        return tab[name].to(model_output.dtype)[t][:, None, None, None]

    C = x_t.shape[1]
    eps, var_values = torch.split(model_output, C, dim=1)
    frozen_eps = eps.detach()
    true_mean = at("coef1") * x_start + at("coef2") * x_t
    min_log, max_log = at("post_log_var"), torch.log(BETAS).to(x_t.dtype)[t][:, None, None, None]
    frac = (var_values + 1) / 2
    log_variance = frac * max_log + (1 - frac) * min_log
    pred_xstart = at("sqrt_recip_ac") * x_t - at("sqrt_recipm1_ac") * frozen_eps
    mean = at("coef1") * pred_xstart + at("coef2") * x_t
    kl = normal_kl(true_mean, min_log, mean, log_variance).mean((1, 2, 3)) / math.log(2.0)
    nll = -discretized_gaussian_log_likelihood(x_start, mean, 0.5 * log_variance)
    vb = torch.where(t == 0, nll.mean((1, 2, 3)) / math.log(2.0), kl) * T_STEPS / 1000.0
    return ((noise - eps) ** 2).mean((1, 2, 3)) + vb


class EpsNet(nn.Module):
    """An ε-and-variance predictor shrunk from improved-diffusion's ``UNetModel``: a conv, the
    timestep's sinusoidal embedding through a Linear added per channel, SiLU, a GroupNorm and
    a conv to twice the image's channels (``learn_sigma``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_in, self.time_embed = nn.Conv2d(3, 6, 3, padding=1), nn.Linear(6, 6)
        self.norm, self.conv_out = nn.GroupNorm(2, 6), nn.Conv2d(6, 6, 3, padding=1)

    def forward(self, x, timesteps):
        h = (
            self.conv_in(x)
            + self.time_embed(timestep_embedding(timesteps).to(x.dtype))[:, :, None, None]
        )
        return self.conv_out(self.norm(F.silu(h)))


class LossSecondMomentResampler:
    """``improved_diffusion/resample.py``'s ``LossSecondMomentResampler``: uniform until every
    timestep has ``history_per_term`` losses, then each timestep drawn with a probability
    proportional to the root mean square of its recent losses (plus ``uniform_prob``); each
    example weighted by ``1 / (T * p[t])`` so that the weighted loss stays unbiased."""

    def __init__(self, history_per_term: int = 1, uniform_prob: float = 0.001) -> None:
        self.history = torch.zeros(T_STEPS, history_per_term, dtype=D)
        self.counts = torch.zeros(T_STEPS, dtype=torch.long)
        self.per_term, self.uniform_prob = history_per_term, uniform_prob

    def weights(self):
        if not (self.counts == self.per_term).all():
            return torch.ones(T_STEPS, dtype=D)
        w = self.history.pow(2).mean(-1).sqrt()
        return w / w.sum() * (1 - self.uniform_prob) + self.uniform_prob / T_STEPS

    def sample(self, batch_size: int, g: torch.Generator):
        p = self.weights() / self.weights().sum()
        t = torch.multinomial(p, batch_size, replacement=True, generator=g)
        return t, 1 / (T_STEPS * p[t])

    def update_with_local_losses(self, ts, losses) -> None:
        for t, loss in zip(ts.tolist(), losses.tolist()):
            if self.counts[t] == self.per_term:
                self.history[t, :-1] = self.history[t, 1:].clone()
                self.history[t, -1] = loss
            else:
                self.history[t, self.counts[t]] = loss
                self.counts[t] += 1


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16 autocast"])
def test_improved_diffusion_hybrid_loss_with_importance_sampled_timesteps(bf16):
    """openai/improved-diffusion ``improved_diffusion/train_util.py`` (``TrainLoop.run_step``,
    ``forward_backward``, ``optimize_normal``) over ``gaussian_diffusion.py`` and
    ``resample.py``, with ``--learn_sigma True --use_kl False --schedule_sampler
    loss-second-moment``: ``zero_grad(self.model_params)`` (each ``.grad`` zeroed in place,
    by hand) at the start of the step; a batch of 4 in micro-batches of 2, each with its
    timesteps and importance weights from the sampler, ``update_with_local_losses(t,
    losses["loss"].detach())``, ``loss = (losses["loss"] * weights).mean()`` and its backward;
    then ``_log_grad_norm``, Adam and the EMA of the parameters (``update_ema``: ``targ.mul_(
    rate).add_(src, alpha=1 - rate)``). The variational bound reaches the network only through
    the variance's output (the ε it uses is detached), the mean squared error only through ε;
    the sampler (``history_per_term=1``, its draws from a generator of their own) leaves the
    uniform draw once warmed up, from the third step. At every micro-batch of five steps grad1
    (summed over the step's micro-batches, as ``.grad``) is the float64 loop's of each
    example's weighted loss over the micro-batch's size: exactly in float64, within bfloat16's
    rounding under bfloat16 autocast (the model float32)."""
    dtype = torch.float32 if bf16 else D
    model = EpsNet().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = [p.detach().clone() for p in model.parameters()]
    sampler, g = LossSecondMomentResampler(), torch.Generator().manual_seed(0)
    draws = torch.Generator().manual_seed(0)  # (the timesteps', apart from the data's)
    warmed = False
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(5):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
            batch = torch.rand(4, 3, 4, 4, generator=g, dtype=D) * 2 - 1
            want: dict = {}
            for i in range(0, 4, 2):
                micro = batch[i : i + 2]
                warmed |= bool((sampler.counts == sampler.per_term).all())
                t, weights = sampler.sample(2, draws)
                noise = torch.randn(micro.shape, generator=g, dtype=D)
                tab = diffusion_tables()
                x_t = (
                    tab["sqrt_ac"][t][:, None, None, None] * micro
                    + tab["sqrt_1mac"][t][:, None, None, None] * noise
                )
                scaled = t.to(D) * (1000.0 / T_STEPS)  # (_scale_timesteps)

                def own(out, target):
                    x0, x_t_i, eps, rest = target.split([3, 3, 3, 2], dim=1)
                    ti, w = rest[:, 0, 0, 0].long(), rest[:, 1, 0, 0]
                    return (hybrid_losses(out, x0, x_t_i, eps, ti) * w).sum() / 2

                rest = torch.stack([t.to(D), weights], 1)[:, :, None, None].expand(2, 2, 4, 4)
                packed = torch.cat([micro, x_t, noise, rest], dim=1)
                mine = loop_grad(reference(model), own, (x_t, scaled), packed)
                want = {n: want.get(n, 0) + mine[n] for n in mine}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(x_t.to(dtype), scaled)
                losses = hybrid_losses(
                    out.to(dtype), micro.to(dtype), x_t.to(dtype), noise.to(dtype), t
                )
                sampler.update_with_local_losses(t, losses.detach())
                (losses * weights.to(dtype)).mean().backward()
                if bf16:
                    got = {n: p.grad1 for n, p in model.named_parameters()}
                    assert_near(got, want, BF16, f"step {step}, micro-batch {i // 2}")
                else:
                    assert_grad1(model, want, f"step {step}, micro-batch {i // 2}")
            grad_norm = sum(p.grad.pow(2).sum() for p in model.parameters()).sqrt()
            assert torch.isfinite(grad_norm)
            opt.step()
            with torch.no_grad():
                for targ, src in zip(ema, model.parameters()):
                    targ.mul_(0.9999).add_(src, alpha=1 - 0.9999)
    assert warmed


# -- huggingface/transformers examples/pytorch/multiple-choice/run_swag_no_trainer.py -----------


class Keywords(nn.Module):
    """``model(**batch)`` as a function of positional tensors, for the loop."""

    def __init__(self, model, names) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        return self.model(**dict(zip(self.names, tensors)))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_run_swag_no_trainer_multiple_choice_folds_the_choices_into_the_batch(
    accelerate_state, mixed_precision  # noqa: F811 (the fixture imported)
):  # fmt: skip
    """huggingface/transformers ``examples/pytorch/multiple-choice/run_swag_no_trainer.py``:
    ``AutoModelForMultipleChoice`` (here a one-layer ``BertForMultipleChoice``), whose forward
    folds the choices into the batch (``input_ids.view(-1, input_ids.size(-1))``: rows
    ``[question * choices, tokens]``), scores each row and unfolds the scores
    (``logits.view(-1, num_choices)``), the loss inside (``labels``: the cross-entropy's mean
    over the questions); ``accelerator.prepare`` of the model, AdamW in decay groups
    (``bias``, ``LayerNorm.weight`` without), and ``get_scheduler("linear")``; per batch
    ``with accelerator.accumulate(model)`` (``gradient_accumulation_steps=2``),
    ``accelerator.backward(outputs.loss)``, ``optimizer.step()``, ``lr_scheduler.step()``,
    ``optimizer.zero_grad()``. The examples are the questions: at each of four batches grad1
    (summed over the accumulated batches, as ``.grad``) is the float64 loop's of each
    question's loss over its choices, over 2: exactly in float64, within bfloat16's rounding
    with ``mixed_precision="bf16"``."""
    transformers = pytest.importorskip("transformers")
    config = tiny_bert_config()
    torch.manual_seed(0)
    model = hf("BertForMultipleChoice")(config).to(D if mixed_precision == "no" else torch.float32)
    acc = accelerate_state.Accelerator(cpu=True, gradient_accumulation_steps=2,
                                 mixed_precision=mixed_precision)  # fmt: skip
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=4)
    prepared, opt, scheduler = acc.prepare(model, opt, scheduler)
    names = ("input_ids", "attention_mask", "token_type_ids", "labels")
    g, want = torch.Generator().manual_seed(0), {}
    with gradhooks.add_hooks(prepared):
        for step in range(4):
            input_ids = torch.randint(1, 20, (3, 2, 6), generator=g)
            lengths = torch.randint(4, 7, (3, 2), generator=g)
            attention_mask = (torch.arange(6) < lengths[..., None]).long()
            token_type_ids = (torch.arange(6) >= 3).long().expand(3, 2, 6)
            labels = torch.randint(2, (3,), generator=g)
            batch = dict(zip(names, (input_ids, attention_mask, token_type_ids, labels)))
            twin = Keywords(copy.deepcopy(model).to(D), names)
            mine = loop_grad(twin, lambda out: out.loss / 2, tuple(batch.values()))
            mine = {n.removeprefix("model."): w for n, w in mine.items()}
            want = mine if step % 2 == 0 else {n: want[n] + mine[n] for n in mine}
            with acc.accumulate(prepared):
                outputs = prepared(**batch)
                acc.backward(outputs.loss)
                if mixed_precision == "bf16":
                    got = {n: p.grad1 for n, p in prepared.named_parameters()}
                    assert_near(got, want, BF16, f"batch {step}")
                else:
                    assert_grad1(prepared, want, f"batch {step}")
                opt.step()
                scheduler.step()
                opt.zero_grad()


# -- facebookresearch/dino: multi-crop, the backbone run once per resolution ---------------------


class DinoHead(nn.Module):
    """facebookresearch/dino ``vision_transformer.py``'s ``DINOHead``: an MLP to a
    bottleneck, ``F.normalize``, and ``last_layer``, ``nn.utils.weight_norm`` of a Linear
    without bias whose ``weight_g`` is fixed at 1 (``norm_last_layer=True``)."""

    def __init__(self, dim: int = 6, hidden: int = 8, bottleneck: int = 4, out: int = 5) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, bottleneck))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck, out, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class MultiCropWrapper(nn.Module):
    """dino ``utils.py``'s ``MultiCropWrapper``: the crops grouped by resolution
    (``torch.unique_consecutive`` of their widths), the backbone run once per group on the
    group's crops concatenated, the features concatenated, the head run once on all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(6, 6),
        )  # fmt: skip
        self.head = DinoHead()

    def forward(self, *x):
        x = list(x)
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)  # fmt: skip
        start_idx, output = 0, torch.empty(0, dtype=x[0].dtype)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


def dino_loss(student_output, teacher_out, ncrops: int = 4, student_temp: float = 0.1):
    """dino ``main_dino.py``'s ``DINOLoss.forward`` given the teacher's sharpened, centred
    probabilities of the two global crops (``[batch, 2, out]``): each student crop's
    cross-entropy to each other global crop's teacher, averaged over the batch and the pairs."""
    student_out = (student_output / student_temp).chunk(ncrops)
    total_loss, n_loss_terms = 0, 0
    for iq in range(2):
        q = teacher_out[:, iq]
        for v in range(ncrops):
            if v == iq:
                continue
            total_loss = (
                total_loss + torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
            )
            n_loss_terms += 1
    return total_loss / n_loss_terms


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize("fp16", [False, True], ids=["float64", "fp16"])
def test_dino_multi_crop_backbone_run_per_resolution_and_the_head_on_all_crops(fp16):
    """facebookresearch/dino ``main_dino.py`` (``train_one_epoch``, ``DINOLoss``) and
    ``utils.py`` (``MultiCropWrapper``, ``clip_gradients``, ``cancel_gradients_last_layer``):
    each image's two global crops (8x8) and two local crops (4x4), the student's backbone run
    on the two global crops of the batch concatenated (``[2 * batch]``), then on the two local
    ones, the head on the four crops' features at once; the teacher (an EMA copy, not hooked)
    on the global crops, its output centred and sharpened; ``DINOLoss`` over each pair of a
    student crop and another global crop's teacher; with ``use_fp16`` the backward through
    ``fp16_scaler`` and ``unscale_``; ``clip_gradients`` (each parameter's own norm clipped to
    3.0); during the first epoch the last layer's ``.grad`` set to ``None``; the step; the
    teacher's EMA and the centre's update. An image's crops are rows of one example in every
    call: at each of three steps grad1 is the float64 loop's of each image's loss, summed
    over its crops (exactly in float64; over the scale, within float16's rounding under
    float16 autocast); the last layer's ``weight_g``, fixed, has none."""
    dtype = torch.float32 if fp16 else D
    student = MultiCropWrapper().to(dtype)
    teacher = MultiCropWrapper().to(dtype)  # (built apart and loaded, as the script does)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=fp16)
    center, g = torch.zeros(1, 5, dtype=dtype), torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(student):
        for it in range(STEPS):
            images = [torch.randn(4, 3, 8, 8, generator=g, dtype=D) for _ in range(2)]
            images += [torch.randn(4, 3, 4, 4, generator=g, dtype=D) for _ in range(2)]
            with torch.no_grad(), autocast:
                teacher_output = teacher(*(im.to(dtype) for im in images[:2]))
            teacher_out = F.softmax((teacher_output - center) / 0.04, dim=-1)
            teacher_out = torch.stack(teacher_out.detach().chunk(2), 1)  # [batch, 2, out]
            twin = MultiCropWrapper().to(D)  # (old weight_norm's modules do not deep-copy)
            twin.load_state_dict(student.state_dict())
            twin.head.last_layer.weight_g.requires_grad = False
            want = loop_grad(
                twin, lambda out, t: dino_loss(out, t), tuple(images), teacher_out.to(D)
            )
            with autocast:
                student_output = student(*(im.to(dtype) for im in images))
            loss = dino_loss(student_output, teacher_out)
            opt.zero_grad()
            scale = scaler.get_scale() if fp16 else 1.0
            scaler.scale(loss).backward()
            if fp16:
                got = {n: p.grad1 / scale for n, p in student.named_parameters() if p.requires_grad}
                assert_near(got, want, FP16, f"step {it}")
            else:
                assert_grad1(student, want, f"step {it}", frozen_clean=True)
            scaler.unscale_(opt)
            for p in student.parameters():
                if p.grad is not None:
                    clip_coef = 3.0 / (p.grad.norm(2) + 1e-6)
                    if clip_coef < 1:
                        p.grad.mul_(clip_coef)
            if it == 0:
                for n, p in student.named_parameters():
                    if "last_layer" in n:
                        p.grad = None
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                    param_k.data.mul_(0.99).add_((1 - 0.99) * param_q.detach().data)
                center = center * 0.9 + teacher_output.mean(0, keepdim=True) * 0.1


# -- huggingface/trl GRPOTrainer: group-relative advantages, a KL to the reference per token ------


def selective_log_softmax(logits, index):
    """trl ``trl/trainer/utils.py``'s ``selective_log_softmax``: the log-probability of each
    ``index`` under ``logits``; in float32 or float64 the gathered logits minus a
    ``logsumexp`` taken row by row (a Python loop over the batch, for memory), in lower
    precisions a ``log_softmax`` per row."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        return selected - torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
    rows = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def per_token_logps(model, input_ids, attention_mask, logits_to_keep: int):
    """``GRPOTrainer._get_per_token_logps``: the logits of the last ``logits_to_keep + 1``
    positions (``logits_to_keep=``), the last dropped, the completion's log-probabilities."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   logits_to_keep=logits_to_keep + 1).logits[:, :-1, :]  # fmt: skip
    return selective_log_softmax(logits, input_ids[:, -logits_to_keep:])


def grpo_losses(logps, ref_logps, advantages, completion_mask, beta: float = 0.04):
    """``GRPOTrainer.compute_loss``: the KL estimate ``exp(ref - logp) - (ref - logp) - 1``,
    ``exp(logp - logp.detach()) * advantage`` (the ratio to the policy that sampled, 1 in
    value), ``-(that - beta * kl)``; each completion's mean over its tokens, ``[batch]``."""
    per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    per_token_loss = torch.exp(logps - logps.detach()) * advantages.unsqueeze(1)
    per_token_loss = -(per_token_loss - beta * per_token_kl)
    return (per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)


class LogProbs(nn.Module):
    """``per_token_logps`` of a model, as a module, for the loop."""

    def __init__(self, model, logits_to_keep: int) -> None:
        super().__init__()
        self.model, self.keep = model, logits_to_keep

    def forward(self, input_ids, attention_mask):
        return per_token_logps(self.model, input_ids, attention_mask, self.keep)


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16 autocast"])
def test_trl_grpo_group_relative_advantages_and_the_kl_to_the_reference(bf16):
    """huggingface/trl ``trl/trainer/grpo_trainer.py`` (``_prepare_inputs``,
    ``_get_per_token_logps``, ``compute_loss``) and ``trl/trainer/utils.py``
    (``selective_log_softmax``): 2 prompts (left-padded) with ``num_generations=3`` sampled
    completions each (cut after their first end-of-sequence token: ``completion_mask``), the
    rewards normalized within each prompt's group (``(rewards - mean_grouped_rewards) /
    (std_grouped_rewards + 1e-4)``), the frozen reference model's log-probabilities under
    ``no_grad``; then the policy's ``per_token_logps`` (a GPT-2 called with
    ``logits_to_keep``), the loss of ``grpo_losses``' mean over the completions, backward, the
    clip and AdamW. The examples are the completions (three share each prompt): at each of
    three steps grad1 and the norms are the float64 loop's of each completion's mean token
    loss, exactly in float64, within bfloat16's rounding under bfloat16 autocast (the model
    float32)."""
    dtype = torch.float32 if bf16 else D
    config = hf("GPT2Config")(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=16,
                              resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    torch.manual_seed(0)
    model = hf("GPT2LMHeadModel")(config).to(dtype)
    ref_model = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eos, keep, g = 15, 4, torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            prompt_ids = torch.randint(1, 15, (2, 3), generator=g).repeat_interleave(3, dim=0)
            prompt_mask = torch.ones_like(prompt_ids)
            prompt_mask[:3, 0] = 0  # (the first prompt is one token shorter: padded left)
            completion_ids = torch.randint(1, 16, (6, keep), generator=g)
            is_eos = completion_ids == eos
            eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((6,), keep))
            completion_mask = (torch.arange(keep) <= eos_idx[:, None]).long()
            input_ids = torch.cat([prompt_ids, completion_ids], 1)
            attention_mask = torch.cat([prompt_mask, completion_mask], 1)
            rewards = torch.randn(6, generator=g, dtype=D)
            grouped = rewards.view(-1, 3)
            advantages = (rewards - grouped.mean(1).repeat_interleave(3)) / (
                grouped.std(1).repeat_interleave(3) + 1e-4
            )  # fmt: skip
            with torch.no_grad():
                ref_logps = per_token_logps(ref_model, input_ids, attention_mask, keep).to(D)

            def own(logps, t):
                ref, adv, mask = t[:, :keep], t[:, keep], t[:, keep + 1 :]
                return grpo_losses(logps, ref, adv, mask).sum()

            packed = torch.cat([ref_logps, advantages[:, None], completion_mask.to(D)], 1)
            want = loop_grad(
                LogProbs(reference(model), keep), own, (input_ids, attention_mask), packed
            )
            want = {n.removeprefix("model."): w for n, w in want.items()}
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logps = per_token_logps(model, input_ids, attention_mask, keep)
            loss = grpo_losses(
                logps, ref_logps.to(dtype), advantages.to(dtype), completion_mask
            ).mean()
            loss.backward()
            assert_step(model, h, want, norms_of(want), bf16, f"step {step}")
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


# -- DLR-RM/stable-baselines3 SAC: critic and actor steps over one replay sample ------------------


class SquashedActor(nn.Module):
    """stable-baselines3 ``sac/policies.py``'s ``Actor`` with ``SquashedDiagGaussian
    Distribution``: ``latent_pi``, ``mu`` and ``log_std`` heads (the log-std clamped to
    ``[-20, 2]``), the action ``tanh(mean + std * noise)`` by ``rsample`` (the noise drawn in
    the call, or given, for the loop), its log-probability corrected for the squashing."""

    def __init__(self, obs: int = 3, act: int = 2) -> None:
        super().__init__()
        self.latent_pi = nn.Sequential(nn.Linear(obs, 8), nn.ReLU())
        self.mu, self.log_std = nn.Linear(8, act), nn.Linear(8, act)

    def action_log_prob(self, obs, noise=None):
        latent_pi = self.latent_pi(obs)
        mean_actions = self.mu(latent_pi)
        log_std = torch.clamp(self.log_std(latent_pi), -20, 2)
        noise = torch.randn_like(mean_actions) if noise is None else noise
        gaussian_actions = mean_actions + log_std.exp() * noise
        log_prob = torch.distributions.Normal(mean_actions, log_std.exp()).log_prob(
            gaussian_actions
        )
        actions = torch.tanh(gaussian_actions)
        log_prob = log_prob.sum(-1) - torch.log(1 - actions**2 + 1e-6).sum(-1)
        return actions, log_prob


class TwinCritic(nn.Module):
    """``common/policies.py``'s ``ContinuousCritic`` with ``n_critics=2``: each Q-network on
    ``th.cat([features, actions], dim=1)``; returns a tuple of the two."""

    def __init__(self, obs: int = 3, act: int = 2) -> None:
        super().__init__()
        self.q_networks = nn.ModuleList(
            nn.Sequential(nn.Linear(obs + act, 8), nn.ReLU(), nn.Linear(8, 1)) for _ in range(2)
        )  # fmt: skip

    def forward(self, obs, actions):
        qvalue_input = torch.cat([obs, actions], dim=1)
        return tuple(q_net(qvalue_input) for q_net in self.q_networks)


class SacPolicy(nn.Module):
    """``SACPolicy``: the actor and the critic, called through their own methods."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.actor, self.critic = SquashedActor(), TwinCritic()

    def forward(self, obs, noise):
        """The actor's loss terms at ``obs`` (for the loop): the log-probability and the
        smaller Q of the action drawn with ``noise``."""
        actions_pi, log_prob = self.actor.action_log_prob(obs, noise)
        return log_prob, torch.cat(self.critic(obs, actions_pi), dim=1).min(1).values


class CriticOnly(nn.Module):
    def __init__(self, critic) -> None:
        super().__init__()
        self.critic = critic

    def forward(self, obs, actions):
        return torch.cat(self.critic(obs, actions), dim=1)


def test_stable_baselines3_sac_entropy_critic_and_actor_backwards_of_one_sample():
    """DLR-RM/stable-baselines3 ``stable_baselines3/sac/sac.py`` (``SAC.train``) with
    ``ent_coef="auto"``: per gradient step, a replay sample; ``actions_pi, log_prob =
    self.actor.action_log_prob(obs)`` (the noise drawn in the call); the entropy coefficient's
    own loss ``-(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()`` and
    its backward, which reaches no hooked module (``log_ent_coef`` is a bare tensor with its
    own Adam); the target under ``no_grad`` from the actor and the target critic; ``critic_loss
    = 0.5 * sum(F.mse_loss(current_q, target_q_values) for current_q in current_q_values)``,
    the critic's ``zero_grad``, backward and step; then ``actor_loss = (ent_coef * log_prob -
    min_qf_pi).mean()`` over the critic *after* its step, through the actor graph recorded
    before it, the actor's ``zero_grad``, backward and step (the critic's ``.grad`` gets the
    actor loss's part too, kept until its next ``zero_grad``); ``polyak_update`` of the target
    critic. One handle on the policy: at each of three steps the entropy backward writes no
    grad1 and warns of nothing; after the critic's backward its grad1 is the float64 loop's of each transition's
    TD errors, and the actor's, which it does not reach, is the last step's, as its ``.grad``;
    after the actor's, the actor's grad1 is the loop's of each transition's actor loss (the
    same noise), and the critic's is its TD rows plus the actor loss's, as
    ``.grad``."""
    policy = SacPolicy().to(D)
    critic_target = copy.deepcopy(policy.critic).requires_grad_(False)
    actor_opt = torch.optim.Adam(policy.actor.parameters(), lr=3e-3)
    critic_opt = torch.optim.Adam(policy.critic.parameters(), lr=3e-3)
    log_ent_coef = torch.zeros(1, dtype=D, requires_grad=True)
    ent_coef_opt = torch.optim.Adam([log_ent_coef], lr=3e-3)
    target_entropy, g = -2.0, torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(policy):
        for step in range(STEPS):
            obs, next_obs = (
                torch.randn(5, 3, generator=g, dtype=D),
                torch.randn(5, 3, generator=g, dtype=D),
            )
            actions = torch.rand(5, 2, generator=g, dtype=D) * 2 - 1
            rewards, dones = torch.randn(5, 1, generator=g, dtype=D), torch.zeros(5, 1, dtype=D)
            torch.manual_seed(10 + step)
            noise = torch.randn(5, 2, dtype=D)
            torch.manual_seed(10 + step)
            actions_pi, log_prob = policy.actor.action_log_prob(obs)
            log_prob = log_prob.reshape(-1, 1)
            ent_coef = torch.exp(log_ent_coef.detach())
            ent_coef_loss = -(log_ent_coef * (log_prob + target_entropy).detach()).mean()
            ent_coef_opt.zero_grad()
            before = model_state(policy)
            with warnings.catch_warnings():
                warnings.simplefilter("error", gradhooks.GradhooksWarning)
                ent_coef_loss.backward()
            assert_untouched(policy, before)
            ent_coef_opt.step()
            with torch.no_grad():
                next_actions, next_log_prob = policy.actor.action_log_prob(next_obs)
                next_q_values = torch.cat(critic_target(next_obs, next_actions), dim=1)
                next_q_values, _ = torch.min(next_q_values, dim=1, keepdim=True)
                next_q_values = next_q_values - ent_coef * next_log_prob.reshape(-1, 1)
                target_q_values = rewards + (1 - dones) * 0.99 * next_q_values
            td = loop_grad(CriticOnly(reference(policy.critic)),
                           lambda q, y: 0.5 * ((q - y) ** 2).sum(), (obs, actions), target_q_values)  # fmt: skip
            current_q_values = policy.critic(obs, actions)
            critic_loss = 0.5 * sum(
                F.mse_loss(current_q, target_q_values) for current_q in current_q_values
            )
            critic_opt.zero_grad()
            actor_kept = {n: p.__dict__.get("grad1") for n, p in policy.actor.named_parameters()}
            critic_loss.backward()
            for n, p in policy.critic.named_parameters():
                assert_close(p.grad1, td["critic." + n], f"step {step}: critic {n}")
            for n, p in policy.actor.named_parameters():  # (not reached, not zeroed: kept)
                kept = actor_kept[n]
                assert kept is None if step == 0 else torch.equal(p.grad1, kept), n
            critic_opt.step()
            coef = ent_coef.item()
            mine = loop_grad(
                reference(policy), lambda out, c=coef: (c * out[0] - out[1]).sum(), (obs, noise)
            )
            q_values_pi = torch.cat(policy.critic(obs, actions_pi), dim=1)
            min_qf_pi, _ = torch.min(q_values_pi, dim=1, keepdim=True)
            actor_loss = (ent_coef * log_prob - min_qf_pi).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            for n, p in policy.named_parameters():
                want = mine[n] + td[n] if n.startswith("critic.") else mine[n]
                assert_close(p.grad1, want, f"step {step}: after the actor's backward, {n}")
            actor_opt.step()
            with torch.no_grad():
                for param, target_param in zip(
                    policy.critic.parameters(), critic_target.parameters()
                ):
                    target_param.data.mul_(1 - 0.005)
                    torch.add(target_param.data, param.data, alpha=0.005, out=target_param.data)


# -- facebookresearch/deit: a distillation token beside the class token ---------------------------


class DistilledViT(nn.Module):
    """facebookresearch/deit ``models.py``'s ``DistilledVisionTransformer``, shrunk: the
    ``cls_token`` and ``dist_token`` each ``expand``-ed to the batch and concatenated in front
    of the patches, a learned ``pos_embed`` added, a block, the norm; ``head`` on the class
    token's output and ``head_dist`` on the distillation token's; in training both, in eval
    their mean."""

    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dist_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 4 + 2, dim) * 0.02)
        self.blocks, self.norm = nn.Sequential(MaeBlock(dim)), nn.LayerNorm(dim)
        self.head, self.head_dist = nn.Linear(dim, classes), nn.Linear(dim, classes)

    def forward(self, x):
        B = x.shape[0]
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls_tokens = self.cls_token.expand(B, -1, -1)
        dist_token = self.dist_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, dist_token, x), dim=1)
        x = self.norm(self.blocks(x + self.pos_embed))
        x, x_dist = self.head(x[:, 0]), self.head_dist(x[:, 1])
        return (x, x_dist) if self.training else (x + x_dist) / 2


def deit_losses(outputs, targets, teacher_outputs, distillation_type: str, tau: float = 3.0):
    """deit ``losses.py``'s ``DistillationLoss`` over timm's ``SoftTargetCrossEntropy`` (the
    mixed-up soft targets), ``alpha=0.5``: ``hard``, the cross-entropy of the distillation
    head to the teacher's argmax; ``soft``, ``F.kl_div`` of the log-softmaxes at temperature
    ``tau``, summed, times ``tau**2``, over ``outputs_kd.numel()``. Each example's, ``[batch]``
    (the script's loss is their mean)."""
    outputs, outputs_kd = outputs
    base_loss = torch.sum(-targets * F.log_softmax(outputs, dim=-1), dim=-1)
    if distillation_type == "soft":
        kl = F.kl_div(F.log_softmax(outputs_kd / tau, dim=1),
                      F.log_softmax(teacher_outputs / tau, dim=1), reduction="none",
                      log_target=True)  # fmt: skip
        distillation_loss = kl.sum(1) * (tau * tau) / outputs_kd.shape[1]
    else:
        distillation_loss = F.cross_entropy(
            outputs_kd, teacher_outputs.argmax(dim=1), reduction="none"
        )  # fmt: skip
    return base_loss * 0.5 + distillation_loss * 0.5


@pytest.mark.parametrize(
    "distillation_type, fp16", [("hard", False), ("soft", False), ("hard", True)],
    ids=["hard float64", "soft float64", "hard fp16"],
)  # fmt: skip
def test_deit_distillation_token_trained_with_a_teacher_under_mixup(distillation_type, fp16):
    """facebookresearch/deit ``main.py`` and ``engine.py`` (``train_one_epoch``) over
    ``models.py`` and ``losses.py``: timm's ``Mixup`` of the batch with its flip (outside the
    model: each mixed image is an example, its target the mixed one-hot labels), under
    ``torch.cuda.amp.autocast()`` ``outputs = model(samples)`` (the class and distillation
    heads' logits), ``loss = criterion(samples, outputs, targets)`` with the teacher (a frozen
    convnet, not hooked) run under ``no_grad`` inside the criterion; ``zero_grad``; timm's
    ``NativeScaler`` (``scale(loss).backward()``, ``unscale_``, ``clip_grad_norm_``,
    ``step``, ``update``); ``model_ema.update(model)``. At each of three steps grad1 of every
    parameter (both tokens, the position table, both heads) is the float64 loop's of each
    mixed image's loss, with ``--distillation-type hard`` and ``soft``: exactly in float64;
    over the scale, within float16's rounding with float16 autocast. An evaluation in eval
    mode (the heads' mean) between steps writes nothing."""
    dtype = torch.float32 if fp16 else D
    model = DistilledViT().to(dtype)
    torch.manual_seed(3)
    teacher = nn.Sequential(nn.Conv2d(3, 4, 4, stride=4), nn.Flatten(), nn.Linear(16, 3))
    teacher = teacher.to(dtype).requires_grad_(False).eval()
    model_ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=fp16)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            model.train()
            samples = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
            labels = F.one_hot(torch.randint(3, (4,), generator=g), 3).to(D)
            lam = 0.7
            samples = samples * lam + samples.flip(0) * (1 - lam)
            targets = labels * lam + labels.flip(0) * (1 - lam)
            with torch.no_grad(), autocast:
                teacher_outputs = teacher(samples.to(dtype))
            packed = torch.cat([targets, teacher_outputs.to(D)], 1)
            want = loop_grad(
                reference(model),
                lambda out, t: deit_losses(out, t[:, :3], t[:, 3:], distillation_type).sum(),
                samples, packed,
            )  # fmt: skip
            with autocast:
                outputs = model(samples.to(dtype))
                loss = deit_losses(
                    outputs, targets.to(dtype), teacher_outputs, distillation_type
                ).mean()  # fmt: skip
            opt.zero_grad()
            scale = scaler.get_scale() if fp16 else 1.0
            scaler.scale(loss).backward()
            if fp16:
                got = {n: p.grad1 / scale for n, p in model.named_parameters()}
                assert_near(got, want, FP16, f"step {step}")
            else:
                assert_grad1(model, want, f"step {step}")
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                for e, p in zip(model_ema.parameters(), model.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)
            if step == 1:
                model.eval()
                kept = model_state(model)
                with torch.no_grad(), autocast:
                    model(samples.to(dtype))
                assert_untouched(model, kept)


# -- transformers' NEFTune on a PEFT LoRA model (TRL's SFTTrainer with neftune_noise_alpha) -------


class NoisyEmbeddings(nn.Module):
    """The loop's model: ``model`` whose input embedding adds the ``noise`` given (what
    NEFTune's hook drew for the batch), for one example at a time."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.noise = model, None
        model.get_input_embeddings().register_forward_hook(lambda m, i, out: out + self.noise)

    def forward(self, input_ids, noise):
        self.noise = noise
        return self.model(input_ids=input_ids).logits


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16 autocast"])
def test_neftune_noise_on_the_embeddings_of_a_lora_model(bf16):
    """huggingface/transformers ``src/transformers/integrations/neftune.py`` (called as is:
    ``activate_neftune``, ``neftune_post_forward_hook``, ``deactivate_neftune``), as
    ``Trainer`` and trl's ``SFTTrainer`` use it with ``neftune_noise_alpha=5`` on a PEFT
    model: a forward hook on the (frozen) input embedding adds uniform noise of magnitude
    ``alpha / sqrt(tokens * hidden)`` in training mode; LoRA (``r=2``, ``c_attn``) on a GPT-2,
    ``model(input_ids=..., labels=...).loss``, backward, AdamW, ``zero_grad``; NEFTune
    deactivated for the evaluation after the second step (and put back). At each of three
    steps grad1 of the LoRA weights is the float64 loop's of each sequence's loss with the same
    noise: in float64 within float32's rounding (the loss from ``labels`` casts the logits to
    float32), within bfloat16's under bfloat16 autocast; the frozen weights have none."""
    peft = pytest.importorskip("peft")
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    config = hf("GPT2Config")(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=16,
                              resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                           fan_in_fan_out=True, init_lora_weights=False)  # fmt: skip
    dtype = torch.float32 if bf16 else D
    model = peft.get_peft_model(hf("GPT2LMHeadModel")(config), lora).to(dtype)
    twin = NoisyEmbeddings(reference(model))
    handle = activate_neftune(model, 5.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            model.train()
            input_ids = torch.randint(16, (4, 6), generator=g)
            twin.load_state_dict({"model." + k: v for k, v in model.state_dict().items()})
            torch.manual_seed(100 + step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            torch.manual_seed(100 + step)
            mag = 5.0 / math.sqrt(6 * 8)
            noise = torch.zeros(4, 6, 8, dtype=dtype).uniform_(-mag, mag).to(D)

            def lm_loss(logits, ids):
                return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

            want = loop_grad(twin, lm_loss, (input_ids, noise), input_ids)
            want = {n.removeprefix("model."): w for n, w in want.items()}
            opt.zero_grad()
            loss.backward()
            if bf16:
                got = {n: p.grad1 for n, p in model.named_parameters() if p.requires_grad}
                assert_near(got, want, BF16, f"step {step}")
            else:  # (the loss from labels casts the logits to float32)
                scale = max(w.abs().max() for w in want.values()).item()
                assert_grad1(model, want, f"step {step}", True, rtol=0, atol=F32 * scale)
            opt.step()
            if step == 1:
                deactivate_neftune(model, handle)
                model.eval()
                with torch.no_grad():
                    model(input_ids=input_ids)
                handle = activate_neftune(model, 5.0)
    deactivate_neftune(model, handle)


# -- pytorch/torchtune recipes/full_finetune_single_device.py: compiled layers, optimizer in bwd ---


class TuneRMSNorm(nn.Module):
    """torchtune ``modules/rms_norm.py``'s ``RMSNorm``: computed in float32, scaled, cast
    back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.scale = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        )
        return x_normed * self.scale


class TuneLayer(nn.Module):
    """torchtune's ``TransformerSelfAttentionLayer`` shrunk: ``sa_norm``, causal attention by
    ``q_proj``/``k_proj``/``v_proj``/``output_proj`` (no biases), ``mlp_norm`` and the SwiGLU
    ``FeedForward`` (``w2(silu(w1(x)) * w3(x))``), each residual."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.sa_norm, self.mlp_norm = TuneRMSNorm(dim), TuneRMSNorm(dim)
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.output_proj = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 12, bias=False), nn.Linear(dim, 12, bias=False)
        self.w2 = nn.Linear(12, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.sa_norm(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.output_proj(y.transpose(1, 2).reshape(B, T, C))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TuneDecoder(nn.Module):
    """torchtune's ``TransformerDecoder``: ``tok_embeddings``, two layers, ``norm`` and the
    ``output`` projection."""

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TuneLayer(dim) for _ in range(2))
        self.norm, self.output = TuneRMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def sft_loss(logits, labels):
    """The recipe's ``_loss_step``: the labels shifted left (``torch.hstack((labels[..., 1:],
    ignore_labels_cache))``), ``CrossEntropyLoss(ignore_index=-100)`` over the flattened
    tokens: the mean over the batch's labelled tokens."""
    labels = torch.hstack((labels[..., 1:], torch.full((labels.shape[0], 1), -100)))
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )


@pytest.mark.parametrize("dtype", [D, torch.bfloat16], ids=["float64", "bf16"])
def test_torchtune_full_finetune_compiled_layers_and_the_optimizer_in_the_backward(dynamo, dtype):
    """pytorch/torchtune ``recipes/full_finetune_single_device.py`` with ``compile=True
    optimizer_in_bwd=True`` (``dtype=bf16``, the recipe's default: the whole model and its
    optimizer in bfloat16): ``training.compile_model`` compiles each
    ``TransformerSelfAttentionLayer`` in place (``m.compile(backend=...)``, here the
    ``aot_eager`` backend: the recipe's inductor only adds build time),
    ``training.compile_loss`` the loss; ``training.register_optim_in_bwd_hooks`` puts an
    AdamW per parameter, stepped and zeroed by ``register_post_accumulate_grad_hook``, so the
    loop calls neither ``step`` nor ``zero_grad``; per batch ``current_num_tokens = (labels
    != ignore_index).sum()``, ``current_loss = self._loss_step(batch) * current_num_tokens``,
    then (optimizer in backward) ``current_loss / num_tokens`` and its backward. At each of
    three steps grad1 is the float64 loop's of each sequence's labelled tokens' losses over
    the batch's count, at the weights its forward used: exactly in float64, within bfloat16's
    rounding in bfloat16; no ``.grad`` is left."""
    model = TuneDecoder().to(dtype)
    for m in reversed(list(model.modules())):
        if isinstance(m, TuneLayer):
            m.compile(backend="aot_eager")
    loss_fn = torch.compile(sft_loss, backend="aot_eager")
    optim_dict = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}

    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(optim_step) for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    try:
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            for step in range(STEPS):
                tokens = torch.randint(13, (3, 6), generator=g)
                labels = tokens.masked_fill(torch.rand(3, 6, generator=g) < 0.3, -100)
                labels[:, 0], labels[:, 1] = -100, tokens[:, 1]  # (one prompt token; one target)
                num_tokens = (labels[..., 1:] != -100).sum()

                def own(logits, t, num_tokens=num_tokens):
                    return sft_loss(logits, t) * (t[..., 1:] != -100).sum() / num_tokens

                want = loop_grad(reference(model), own, tokens, labels)
                logits = model(tokens)
                current_num_tokens = (labels[..., 1:] != -100).sum()
                current_loss = loss_fn(logits, labels) * current_num_tokens
                (current_loss / num_tokens).backward()
                if dtype == D:
                    assert_grad1(model, want, f"step {step}")
                else:
                    got = {n: p.grad1 for n, p in model.named_parameters()}
                    assert_near(got, want, BF16, f"step {step}")
                assert all(p.grad is None for p in model.parameters())
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_olmo_micro_batches_of_a_private_batch_through_the_dp_optimizer(method):
    """OLMo's ``train_batch`` loop made private: each micro-batch's per-sequence losses (token
    cross-entropies and z-losses over the batch's token count, as above) go to
    ``DPOptimizer.backward`` in place of ``loss.backward()``, the step after the batch's last
    micro-batch (``max_grad_norm=0.05``, no noise, ``expected_batch_size=4``), then
    ``zero_grad``. At each of three steps the per-sequence norms each micro-batch's backward
    returns and the ``.grad`` the step used (kept after AdamW's step) are the float64 loop's:
    each sequence's gradient clipped, summed over the batch's micro-batches, over 4."""
    model = Olmo().to(D)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), h, max_grad_norm=0.05,
            noise_multiplier=0.0, expected_batch_size=4, method=method,
        )  # fmt: skip
        for step in range(STEPS):
            input_ids = torch.randint(13, (4, 6), generator=g)
            lengths = torch.randint(3, 7, (4,), generator=g)
            attention_mask = (torch.arange(6) < lengths[:, None]).long()
            rows: list = []
            for mb in range(2):
                ids, mask = input_ids[2 * mb : 2 * mb + 2], attention_mask[2 * mb : 2 * mb + 2]

                def own(logits, m):
                    return olmo_losses(logits, m[..., 0].long(), m[..., 1], 24).sum()

                packed = torch.stack((ids.to(D), mask.to(D)), -1)
                rows.append(loop_grad(reference(model), own, ids, packed))
                norms = opt.backward(olmo_losses(model(ids), ids, mask, 24))
                assert_close(norms, norms_of(rows[-1]), f"step {step}, micro-batch {mb}: norms")
            want = {n: torch.cat([r[n] for r in rows]) for n in rows[0]}
            opt.step()
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped(want, 0.05, divide=4)[n], f"step {step}: {n}")
            opt.zero_grad()


# -- huggingface/transformers examples/pytorch/question-answering/run_qa_no_trainer.py ----------


def qa_share(out, t):
    """Each example's share of ``BertForQuestionAnswering``'s loss: ``(start_loss +
    end_loss) / 2``, each a cross-entropy's mean over the examples whose position is not
    ``ignored_index`` (the positions clamped to the sequence's length, then ignored); ``t``
    holds the start and end positions and the batch's two counts."""
    start_positions, end_positions = t[:, 0].long(), t[:, 1].long()
    start_count, end_count = t[:, 2], t[:, 3]
    ignored_index = out.start_logits.size(1)
    start_positions = start_positions.clamp(0, ignored_index)
    end_positions = end_positions.clamp(0, ignored_index)
    start = F.cross_entropy(out.start_logits, start_positions, ignore_index=ignored_index,
                            reduction="none") / start_count  # fmt: skip
    end = F.cross_entropy(out.end_logits, end_positions, ignore_index=ignored_index,
                          reduction="none") / end_count  # fmt: skip
    return ((start + end) / 2).sum()


def test_run_qa_no_trainer_start_and_end_means_over_the_answers_in_the_window():
    """huggingface/transformers ``examples/pytorch/question-answering/run_qa_no_trainer.py``
    over ``BertForQuestionAnswering`` (called as is): ``outputs = model(**batch)`` with
    ``start_positions`` and ``end_positions``, the loss inside: one ``qa_outputs`` Linear split
    into the start and end logits, the positions clamped to ``ignored_index`` (the sequence's
    length: an answer cut off by the window), each cross-entropy averaged over the examples
    not ignored; ``accelerator.backward(loss)``, AdamW, the linear schedule, ``zero_grad``.
    One example's end, then another's start and end, lie past the window: with
    ``loss_reduction="sum"`` grad1 is, at each of three steps, the float64 loop's of each
    example's share (its start and end losses over their counts, halved), an example whose
    positions are both cut off has a zero row."""
    transformers = pytest.importorskip("transformers")
    config = tiny_bert_config()
    torch.manual_seed(0)
    model = hf("BertForQuestionAnswering")(config).to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=3)
    names = ("input_ids", "attention_mask", "token_type_ids", "start_positions", "end_positions")
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(STEPS):
            input_ids = torch.randint(1, 20, (4, 7), generator=g)
            attention_mask = torch.ones_like(input_ids)
            token_type_ids = (torch.arange(7) >= 3).long().expand(4, 7)
            start_positions = torch.randint(3, 7, (4,), generator=g)
            end_positions = torch.randint(3, 7, (4,), generator=g)
            end_positions[0] = 9  # (past the window)
            if step > 0:
                start_positions[2], end_positions[2] = 8, 12
            counts = [(p < 7).sum().to(D).expand(4) for p in (start_positions, end_positions)]
            packed = torch.stack([start_positions.to(D), end_positions.to(D), *counts], 1)
            twin = Keywords(reference(model), names[:3])
            want = loop_grad(twin, qa_share, (input_ids, attention_mask, token_type_ids), packed)
            want = {n.removeprefix("model."): w for n, w in want.items()}
            batch = dict(zip(names, (input_ids, attention_mask, token_type_ids, start_positions,
                                     end_positions)))  # fmt: skip
            outputs = model(**batch)
            outputs.loss.backward()
            assert_grad1(model, want, f"step {step}")
            if step > 0:
                assert not model.qa_outputs.weight.grad1[2].any()
            opt.step()
            scheduler.step()
            opt.zero_grad()


# -- PEFT's trainable_token_indices: new tokens' rows trained beside LoRA -------------------------


class Logits(nn.Module):
    """``model(input_ids=...).logits``, for the loop."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def test_peft_trainable_token_rows_beside_lora_in_a_tied_gpt2():
    """huggingface/peft ``src/peft/tuners/trainable_tokens/layer.py`` (called as is), as
    ``LoraConfig(trainable_token_indices=[...])`` is used to train the rows of tokens added
    for a chat template beside LoRA: ``TrainableTokensLayer`` builds the embedding's weight
    anew at each call (``W.index_copy(0, index, trainable_tokens_delta)``, the frozen rows
    kept) and embeds the batch with ``F.embedding(input=x, weight=W)``; the GPT-2's head,
    tied to the embedding, is wrapped as well, sharing the delta (``F.linear`` with ``W``).
    The script's loop: ``model(input_ids=..., labels=...).loss``, backward, AdamW,
    ``zero_grad``. At each of three steps grad1 of the delta (both uses) and of the LoRA
    weights is the float64 loop's of each sequence's loss, within float32's rounding (the
    loss from ``labels`` casts the logits to float32); the frozen weights have none."""
    peft = pytest.importorskip("peft")
    config = hf("GPT2Config")(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=16,
                              resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                           fan_in_fan_out=True, init_lora_weights=False,
                           trainable_token_indices=[3, 5])  # fmt: skip
    model = peft.get_peft_model(hf("GPT2LMHeadModel")(config), lora).to(D)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("trainable_tokens_delta" in n for n in trained), trained
    opt = torch.optim.AdamW([model.get_parameter(n) for n in trained], lr=1e-2)
    g = torch.Generator().manual_seed(0)

    def lm_loss(logits, ids):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            input_ids = torch.randint(16, (4, 6), generator=g)
            input_ids[:, 2] = 3  # (the new tokens in every sequence)
            want = loop_grad(Logits(reference(model)), lm_loss, input_ids, input_ids)
            want = {n.removeprefix("model."): w for n, w in want.items()}
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            assert_grad1(
                model,
                want,
                f"step {step}",
                frozen_clean=True,
                rtol=0,
                atol=F32 * (max(w.abs().max() for w in want.values()).item()),
            )
            delta = next(p for n, p in model.named_parameters() if "trainable_tokens_delta" in n)
            assert delta.grad1.any()
            opt.step()
            opt.zero_grad()


# -- junyanz/pytorch-CycleGAN-and-pix2pix: two generators, two discriminators frozen in turn -----


def cyclegan_generator(seed: int) -> nn.Sequential:
    """A ``ResnetGenerator`` shrunk: a conv, ``InstanceNorm2d`` (``--norm instance``: no
    affine weights), ReLU, a conv, tanh."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 3, 3, padding=1), nn.Tanh(),
    )  # fmt: skip


def cyclegan_discriminator(seed: int) -> nn.Sequential:
    """A ``NLayerDiscriminator`` (PatchGAN) shrunk: a strided conv, LeakyReLU, a conv to one
    channel of patch scores."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(4, 1, 3, padding=1))


def gan_mse(prediction, real: bool):
    """``GANLoss('lsgan')``: the mean squared error to a target of ones or zeros, per
    example, ``[batch]``."""
    target = torch.ones_like(prediction) if real else torch.zeros_like(prediction)
    return ((prediction - target) ** 2).flatten(1).mean(1)


def l1(a, b):
    return (a - b).abs().flatten(1).mean(1)


class CycleGAN(nn.Module):
    """The four networks of ``models/cycle_gan_model.py``'s ``CycleGANModel``;
    ``generator_losses`` is ``forward`` and ``backward_G`` (``lambda_A = lambda_B = 10``,
    ``lambda_identity = 0.5``), ``discriminator_losses`` is ``backward_D_A`` and
    ``backward_D_B`` given the pools' fakes; each example's, ``[batch]``."""

    def __init__(self) -> None:
        super().__init__()
        self.netG_A, self.netG_B = cyclegan_generator(0), cyclegan_generator(1)
        self.netD_A, self.netD_B = cyclegan_discriminator(2), cyclegan_discriminator(3)

    def generator_losses(self, real_A, real_B):
        fake_B = self.netG_A(real_A)
        rec_A = self.netG_B(fake_B)
        fake_A = self.netG_B(real_B)
        rec_B = self.netG_A(fake_A)
        idt_A, idt_B = self.netG_A(real_B), self.netG_B(real_A)
        loss = l1(idt_A, real_B) * 10 * 0.5 + l1(idt_B, real_A) * 10 * 0.5
        loss = loss + gan_mse(self.netD_A(fake_B), True) + gan_mse(self.netD_B(fake_A), True)
        loss = loss + l1(rec_A, real_A) * 10 + l1(rec_B, real_B) * 10
        return loss, fake_A.detach(), fake_B.detach()

    def discriminator_losses(self, real_A, real_B, fake_A, fake_B):
        def basic(netD, real, fake):
            loss_D_real = gan_mse(netD(real), True)
            loss_D_fake = gan_mse(netD(fake.detach()), False)
            return (loss_D_real + loss_D_fake) * 0.5

        return basic(self.netD_A, real_B, fake_B) + basic(self.netD_B, real_A, fake_A)

    def forward(self, real_A, real_B, fake_A=None, fake_B=None):
        """For the loop: the generators' losses, or with the fakes the discriminators'."""
        if fake_A is None:
            return self.generator_losses(real_A, real_B)[0]
        return self.discriminator_losses(real_A, real_B, fake_A, fake_B)


class ImagePool:
    """``util/image_pool.py``'s ``ImagePool``: until full, each generated image is kept and
    returned; then, with probability one half, a kept one is returned in its place and it is
    kept instead."""

    def __init__(self, pool_size: int, rng) -> None:
        self.pool_size, self.images, self.rng = pool_size, [], rng

    def query(self, images):
        return_images = []
        for image in images:
            image = image.unsqueeze(0)
            if len(self.images) < self.pool_size:
                self.images.append(image)
                return_images.append(image)
            elif self.rng.uniform(0, 1) > 0.5:
                random_id = self.rng.randint(0, self.pool_size - 1)
                return_images.append(self.images[random_id].clone())
                self.images[random_id] = image
            else:
                return_images.append(image)
        return torch.cat(return_images, 0)


def test_cyclegan_generators_then_discriminators_frozen_in_turn_with_an_image_pool():
    """junyanz/pytorch-CycleGAN-and-pix2pix ``train.py`` and ``models/cycle_gan_model.py``
    (``optimize_parameters``): ``forward()`` (``fake_B = netG_A(real_A)``, ``rec_A =
    netG_B(fake_B)``, ``fake_A = netG_B(real_B)``, ``rec_B = netG_A(fake_A)``);
    ``set_requires_grad([netD_A, netD_B], False)``; the generators' ``zero_grad``,
    ``backward_G`` (identity, LSGAN and cycle losses: each generator called three times, the
    frozen discriminators once each), their Adam step; ``set_requires_grad(..., True)``; the
    discriminators' ``zero_grad``, ``backward_D_A`` and ``backward_D_B`` on the real images and
    ``fake_pool.query(fake)`` (``util/image_pool.py``: past fakes swapped in at random, detached),
    their step. Each network hooked on its own; an example is a pair of images, one of each
    domain. At each of three steps the generators' grad1 after ``backward_G`` is the float64
    loop's of each pair's generator losses (each generator's three calls summed in its rows),
    the frozen discriminators keep what the last step left them (``.grad`` and grad1 alike),
    and their grad1 after the discriminators' backward is the loop's of each pair's
    discriminator losses (real and pooled fake)."""
    import contextlib
    import random

    model = CycleGAN().to(D)
    nets = [model.netG_A, model.netG_B, model.netD_A, model.netD_B]
    optimizer_G = torch.optim.Adam(
        list(model.netG_A.parameters()) + list(model.netG_B.parameters()), lr=2e-3,
        betas=(0.5, 0.999),
    )  # fmt: skip
    optimizer_D = torch.optim.Adam(
        list(model.netD_A.parameters()) + list(model.netD_B.parameters()), lr=2e-3,
        betas=(0.5, 0.999),
    )  # fmt: skip
    rng = random.Random(0)
    fake_A_pool, fake_B_pool = ImagePool(3, rng), ImagePool(3, rng)
    g = torch.Generator().manual_seed(0)

    def set_requires_grad(ns, requires_grad):
        for net in ns:
            for param in net.parameters():
                param.requires_grad = requires_grad

    def grad1_of(prefix, net):
        return {prefix + n: p.grad1 for n, p in net.named_parameters()}

    with contextlib.ExitStack() as stack:
        for net in nets:
            stack.enter_context(gradhooks.add_hooks(net))
        for step in range(STEPS):
            real_A = torch.rand(4, 3, 8, 8, generator=g, dtype=D) * 2 - 1
            real_B = torch.rand(4, 3, 8, 8, generator=g, dtype=D) * 2 - 1
            set_requires_grad([model.netD_A, model.netD_B], False)
            want = loop_grad(reference(model), lambda out: out.sum(), (real_A, real_B))
            optimizer_G.zero_grad()
            kept = {n: model_state(net) for n, net in (("A", model.netD_A), ("B", model.netD_B))}
            loss_G, fake_A, fake_B = model.generator_losses(real_A, real_B)
            loss_G.mean().backward()
            got = grad1_of("netG_A.", model.netG_A) | grad1_of("netG_B.", model.netG_B)
            for n, w in got.items():
                assert_close(w, want[n], f"step {step}: {n} after backward_G")
            for n, net in (("A", model.netD_A), ("B", model.netD_B)):
                assert_untouched(net, kept[n])
            optimizer_G.step()
            set_requires_grad([model.netD_A, model.netD_B], True)
            fake_B, fake_A = fake_B_pool.query(fake_B), fake_A_pool.query(fake_A)
            want = loop_grad(reference(model), lambda out: out.sum(),
                             (real_A, real_B, fake_A, fake_B))  # fmt: skip
            optimizer_D.zero_grad()
            model.discriminator_losses(real_A, real_B, fake_A, fake_B).mean().backward()
            got = grad1_of("netD_A.", model.netD_A) | grad1_of("netD_B.", model.netD_B)
            for n, w in got.items():
                assert_close(w, want[n], f"step {step}: {n} after backward_D")
            optimizer_D.step()

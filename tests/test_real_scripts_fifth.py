"""Published training scripts, a fifth set, rewritten small, with gradhooks put where their
users put it, each step checked against the float64 per-example loop.

As in the other sets (``test_real_scripts*.py``): each test follows one script of a public
repository (cited in its docstring: repository and path), its model and its loop as written
there, at tiny sizes, on synthetic data, in float64 where the script allows. Here gradhooks
takes the place of the script's own per-example machinery: Opacus' and its forks' privacy
engines (TAN's augmentation multiplicity and NFNet, fastDP's automatic clipping, layer-wise
and DP-BiTFiT, private-transformers' ghost clipping over virtual steps, prompt-based
classification and prefix-tuning, dp-transformers' LoRA through the Hugging Face ``Trainer``
and its author-level DP), the gradient noise scale (k-diffusion's ``GradientNoiseScale``
through ``Denoiser.loss``, McCandlish et al.'s estimate in nanoGPT's loop), k-diffusion's
image transformer v2, Hugging Face's ``run_glue_no_trainer`` under ``accelerate``, K-FAC in
kfac-pytorch's engine, and LESS's gradient features for data selection. At every step what
the script computes from gradhooks (the update, the clipped sum, the norms, the factors, the
scores) is compared with the same computed from each example's own gradient by a float64
loop; where a step draws noise, the noise is drawn again from a generator of the same seed and
taken off; under bfloat16 autocast (where the script uses it) the comparison has a stated
tolerance, and the per-example rows' mean is compared with torch's own gradient.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from harness import assert_close, one_thread  # noqa: F401 (autouse in this module)

D = torch.float64


# -- the float64 reference --------------------------------------------------------------------


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def loop(model: nn.Module, loss_of, *batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [n, *shape]}``: row ``i`` the gradient of ``loss_of(*rows_i)`` (example
    ``i``'s own loss, computed alone on row ``i`` of each tensor of ``batch``) by autograd,
    for every trainable parameter (zeros where it does not reach one)."""
    params = trainable(model)
    rows = []
    with gradhooks.paused():
        for i in range(len(batch[0])):
            loss = loss_of(*(t[i : i + 1] for t in batch))
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            rows.append(
                [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
            )
    return {name: torch.stack([r[k] for r in rows]) for k, name in enumerate(params)}


def flat(per: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(len(g), -1) for g in per.values()], 1)


def clipped_sum(per: dict, bound: float, groups=None, automatic: bool = False) -> dict:
    """``Σ_i f_i g_i`` per parameter, ``f_i = min(1, C/‖g_i‖)`` (or fastDP's automatic
    ``C/(‖g_i‖ + 0.01)``) over each group of parameters (one group of all by default, each
    group clipped to ``C/√K`` of ``K`` groups)."""
    groups = groups or [list(per)]
    c = bound / math.sqrt(len(groups))
    out = {}
    for group in groups:
        norms = torch.cat([per[n].reshape(len(per[n]), -1) for n in group], 1).norm(dim=1)
        f = c / (norms + 0.01) if automatic else (c / norms).clamp(max=1.0)
        for n in group:
            out[n] = torch.einsum("b,b...->...", f, per[n])
    return out


def denoised(model, noise, std: float, denom: float) -> dict:
    """Each trainable parameter's ``.grad · denom`` less the noise ``std · z``, ``z`` drawn
    from ``noise`` parameter after parameter, as the DP step draws it."""
    out = {}
    for n, p in trainable(model).items():
        z = torch.randn(p.shape, generator=noise, dtype=p.dtype)
        out[n] = p.grad * denom - std * z
    return out


def assert_all(got: dict, want: dict, what: str, **tol) -> None:
    assert got and got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for n in want:
        if tol:
            torch.testing.assert_close(
                got[n], want[n].to(got[n].dtype), **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
            )
        else:
            assert_close(got[n], want[n], f"{what}: {n}")


def follow(twin: nn.Module, model: nn.Module) -> None:
    """The float64 twin takes the hooked model's parameters (it follows the noisy
    trajectory, so that the next step's loop runs at the same point)."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.copy_(p)


# -- facebookresearch/tan: augmentation multiplicity ---------------------------------------------


class TinyWideResNet(nn.Module):
    """TAN's ``src/models/wideresnet.py`` in miniature: a stem convolution, one pre-activation
    residual block with GroupNorm (the script's ``nb_groups``) in place of batch norm, global
    average pooling and a linear head."""

    def __init__(self, classes: int = 3, width: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1, self.conv2 = nn.GroupNorm(2, width), nn.Conv2d(width, width, 3, padding=1)
        self.bn2, self.conv3 = nn.GroupNorm(2, width), nn.Conv2d(width, width, 3, padding=1)
        self.bn, self.fc = nn.GroupNorm(2, width), nn.Linear(width, classes)

    def forward(self, x):
        h = self.conv1(x)
        h = h + self.conv3(F.relu(self.bn2(self.conv2(F.relu(self.bn1(h))))))
        return self.fc(F.relu(self.bn(h)).mean((2, 3)))


class Views(nn.Module):
    """The network run on ``[batch, K, C, H, W]``: the K augmented views of each example kept
    on their own dimension, so that the batch is still the examples'."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.flatten(0, 1)).unflatten(0, x.shape[:2])


def augment(images: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """TAN's ``RandomCrop(padding=4, padding_mode="reflect")`` and ``RandomHorizontalFlip``
    on K copies of each image (here a padding of 1 on 6x6 images): ``[batch, K, C, H, W]``."""
    b, _, h, w = images.shape
    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    out = torch.empty(b, k, *images.shape[1:], dtype=images.dtype)
    for i in range(b):
        for j in range(k):
            dy, dx = torch.randint(3, (2,), generator=g).tolist()
            view = padded[i, :, dy : dy + h, dx : dx + w]
            out[i, j] = view.flip(-1) if torch.rand((), generator=g) < 0.5 else view
    return out


def decay_groups(model: nn.Module) -> list[dict]:
    """The Hugging Face scripts' two parameter groups: weight decay 0.01, none for the biases
    and the LayerNorm weights (``no_decay = ["bias", "LayerNorm.weight"]``)."""
    no_decay = ["bias", "LayerNorm.weight"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip


def test_tan_cifar10_augmentation_multiplicity_averages_the_views_before_clipping():
    """facebookresearch/tan ``cifar10.py`` with ``--transform K``: each image is repeated K
    times (``torch.repeat_interleave``) and each copy cropped and flipped at random; TAN's
    grad samplers (``src/models/augmented_grad_samplers.py``) reshape the rows into
    ``[batch, K]`` and reduce over K, so that each example's gradient, averaged over its views,
    is clipped once. With gradhooks the per-example losses of the repeated rows, reduced over
    the views, are refused (the forward's batch is ``batch·K``: the message says to stack the
    views), and with the views stacked, ``[batch, K, ...]``, ``DPOptimizer`` over SGD with the
    script's ``BatchMemoryManager`` split (physical batches of ``max_physical // K`` images) is
    the loop's: the logged per-example norms are those of each example's gradient of its
    views' mean loss, and ``.grad``, the noise drawn again and taken off, the clipped sum over
    the batch size, for 2 steps; the script's EMA copy is unhooked and follows the model."""
    C, SIGMA, B, K = 1.0, 0.6, 4, 2
    torch.manual_seed(0)
    model = Views(TinyWideResNet()).to(D)
    twin = copy.deepcopy(model)
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0)
    g = torch.Generator().manual_seed(3)
    noise, again = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            opt, h, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=B,
            generator=noise,
        )  # fmt: skip
        for step in range(2):
            images = torch.randn(B, 3, 6, 6, generator=g, dtype=D)
            target = torch.randint(3, (B,), generator=g)
            views = augment(images, K, g)
            if step == 0:  # the script's own form: the copies along the batch
                rows = model.net(views.flatten(0, 1))
                per_row = F.cross_entropy(rows, target.repeat_interleave(K), reduction="none")
                with pytest.raises(gradhooks.ConfigurationError, match="views"):
                    dp.backward(per_row.view(B, K).mean(1))
            norms = []
            for half in (slice(0, B // 2), slice(B // 2, B)):  # BatchMemoryManager's split
                out = model(views[half])  # [batch, K, classes]
                y = target[half].repeat_interleave(K)
                losses = F.cross_entropy(out.flatten(0, 1), y, reduction="none")
                norms.append(dp.backward(losses.view(-1, K).mean(1)))
            assert dp.step()
            per = loop(twin, lambda v, t: F.cross_entropy(twin(v)[0], t.repeat(K)), views, target)
            torch.testing.assert_close(torch.cat(norms), flat(per).norm(dim=1))
            got = denoised(model, again, SIGMA * C, B)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            dp.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
            follow(twin, model)
    assert all(not hasattr(p, "grad1") for p in ema.parameters())
    assert not torch.equal(ema.net.fc.weight, model.net.fc.weight)


# -- awslabs/fast-differential-privacy: automatic clipping, layer-wise, DP-BiTFiT ----------------


class TinyViT(nn.Module):
    """timm's ``VisionTransformer`` in miniature, as fastDP's ``CIFAR_TIMM.py`` fine-tunes it
    (``vit_small_patch16_224``): a convolutional patch embedding, a class token and position
    embedding used by the model itself, one pre-norm block (timm's ``Attention`` with one
    ``qkv`` linear, and its MLP), a final LayerNorm and the head on the class token."""

    def __init__(self, dim: int = 8, classes: int = 3, heads: int = 2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 2, stride=2)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, 5, dim))
        self.norm1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.norm2, self.fc1, self.fc2 = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 2 * dim),
            nn.Linear(2 * dim, dim),
        )
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)
        self.heads = heads

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, 4, dim]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, c))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x)[:, 0])


def modules_of(model: nn.Module) -> list[list[str]]:
    """The trainable parameters' names grouped by the module that holds them (fastDP's
    layers; the model's own ``cls_token`` and ``pos_embed`` one group of the root)."""
    groups: dict[str, list[str]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(name.rpartition(".")[0], []).append(name)
    return list(groups.values())


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "layer-wise", "BiTFiT"])
def test_fastdp_cifar_timm_automatic_clipping_with_accumulation(mode):
    """awslabs/fast-differential-privacy ``examples/image_classification/CIFAR_TIMM.py``:
    fastDP's ``PrivacyEngine`` attached to Adam, its default automatic clipping
    (``clipping_fn="automatic"``: each gradient scaled by ``C/(‖g_i‖ + 0.01)``, Bu et al.),
    ``clipping_style="all-layer"`` (book-keeping, ``--clipping_mode BK-MixOpt``, or ghost
    clipping, ``BK-ghost``) or ``"layer-wise"`` (each layer to ``C/√L``), or DP-BiTFiT
    (``--clipping_mode BiTFiT``: every parameter but the biases frozen), and the loop's
    gradient accumulation: ``n_acc_steps = bs // mini_bs`` mini-batches, ``optimizer.step()``
    after the last. Here ``gradhooks.DPOptimizer(clipping="automatic", clipping_groups=...,
    method=...)``
    takes fastDP's place: ``opt.backward(per-example losses)`` per mini-batch. After each of 2
    logical steps of 2 mini-batches ``.grad``, the noise taken off, is the loop's clipped sum
    over the logical batch, and in BiTFiT the frozen weights do not move and have no
    ``grad1``."""
    C, SIGMA, BS, MINI = 1.0, 0.5, 4, 2
    torch.manual_seed(0)
    model = TinyViT().to(D)
    if mode == "BiTFiT":
        for name, p in model.named_parameters():
            if not name.endswith("bias"):
                p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    twin = copy.deepcopy(model)
    groups = modules_of(model) if mode == "layer-wise" else None
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    noise, again = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            opt, h, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=BS,
            generator=noise, clipping="automatic",
            clipping_groups="layer" if mode == "layer-wise" else None,
            method="ghost" if mode == "BK-ghost" else None,
        )  # fmt: skip
        for step in range(2):
            inputs = torch.randn(BS, 3, 4, 4, generator=g, dtype=D)
            targets = torch.randint(3, (BS,), generator=g)
            for batch_idx in range(BS // MINI):
                rows = slice(batch_idx * MINI, (batch_idx + 1) * MINI)
                outputs = model(inputs[rows])
                dp.backward(F.cross_entropy(outputs, targets[rows], reduction="none"))
                if (batch_idx + 1) % (BS // MINI) == 0:
                    dp.step()
                    per = loop(twin, lambda x, y: F.cross_entropy(twin(x), y), inputs, targets)
                    want = clipped_sum(per, C, groups, automatic=True)
                    got = denoised(model, again, SIGMA * C, BS)
                    assert_all(got, want, f"{mode} step {step}", rtol=1e-9, atol=1e-11)
                    dp.zero_grad()
            follow(twin, model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and not hasattr(p, "grad1"), n
    if mode == "BiTFiT":
        assert frozen and all(n.endswith("bias") for n, _ in trainable(model).items())


# -- lxuechen/private-transformers: table-to-text with ghost clipping over virtual steps -------

V, T = 24, 9  # vocabulary, sequence length of the language-model tests


def transformers_or_skip():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def tiny_gpt2(seed: int = 0, **more):
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_embd=8, n_layer=1, n_head=2, vocab_size=V, n_positions=T, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, **more,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(D)


def table2text_batch(g: torch.Generator, n: int):
    """Right-padded ``table <bos> text`` sequences as private-transformers'
    ``DataCollatorForData2TextLanguageModeling`` gives them: label -100 on the table (the
    prompt) and on the padding."""
    ids = torch.randint(1, V, (n, T), generator=g)
    src = torch.randint(2, 4, (n,), generator=g)
    lengths = torch.randint(6, T + 1, (n,), generator=g)
    pos = torch.arange(T)
    mask = (pos < lengths[:, None]).long()
    labels = ids.masked_fill((pos < src[:, None]) | (mask == 0), -100)
    return ids * mask, mask, labels


def table2text_loss(model, ids, mask, labels):
    """private-transformers' ``compute_loss``: the shifted token losses summed per sequence
    over its labelled tokens and divided by their count (``(batch_size,)``)."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
    seq_lens = (shift_labels != -100).sum(dim=1)
    loss = F.cross_entropy(shift_logits.permute(0, 2, 1), shift_labels, reduction="none")
    return loss.sum(dim=1) / seq_lens


def test_private_transformers_table2text_ghost_clipping_virtual_steps_and_warmup():
    """lxuechen/private-transformers ``examples/table2text/trainer.py``: GPT-2 (its output
    layer the token embedding), ``compute_loss``'s vector loss (each sequence's mean over its
    labelled text tokens), ``optimizer.virtual_step(loss=vector_loss)`` on every micro-batch
    but the last of ``gradient_accumulation_steps`` and ``optimizer.step(loss=vector_loss)``
    on it, AdamW with the script's decay groups (``no_decay = ["bias", "LayerNorm.weight"]``)
    and ``get_linear_schedule_with_warmup``, in the engine's default ghost clipping. Here
    ``DPOptimizer(method="ghost")`` on ``add_hooks(model, quantities=("norms",))``:
    ``opt.backward(vector_loss)`` per micro-batch and ``opt.step()`` after the last. At each of
    2 steps the norms of each micro-batch are the loop's, and ``.grad``, the noise taken off,
    is the loop's clipped sum over the logical batch (never forming ``grad1``)."""
    transformers = transformers_or_skip()
    C, SIGMA, MICRO, ACC = 0.5, 0.8, 2, 2
    model = tiny_gpt2()
    twin = copy.deepcopy(model)
    groups = decay_groups(model)
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 1, 4)
    noise, again = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            optimizer, h, max_grad_norm=C, noise_multiplier=SIGMA,
            expected_batch_size=MICRO * ACC, generator=noise, method="ghost",
        )  # fmt: skip
        for step in range(2):
            batches = [table2text_batch(g, MICRO) for _ in range(ACC)]
            norms = []
            for ids, mask, labels in batches:
                norms.append(dp.backward(table2text_loss(model, ids, mask, labels)))
            dp.step()
            scheduler.step()
            ids, mask, labels = (torch.cat(t) for t in zip(*batches))
            per = loop(twin, lambda *row: table2text_loss(twin, *row)[0], ids, mask, labels)
            torch.testing.assert_close(torch.cat(norms), flat(per).norm(dim=1))
            got = denoised(model, again, SIGMA * C, MICRO * ACC)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            assert all(not hasattr(p, "grad1") for p in model.parameters())
            dp.zero_grad()
            follow(twin, model)
    assert scheduler.get_last_lr()[0] < 1e-2


# -- the gradient noise scale: k-diffusion's GradientNoiseScale, McCandlish et al. ------------


class GradientNoiseScale:
    """crowsonkb/k-diffusion ``k_diffusion/gns.py``'s ``GradientNoiseScale.update`` (the
    estimators of Appendix A of McCandlish et al., 2018, from a small and a large batch's
    squared gradient norms, each smoothed by an exponential moving average)."""

    def __init__(self, beta: float = 0.9, eps: float = 1e-8):
        self.beta, self.eps = beta, eps
        self.ema_sq_norm = self.ema_var = 0.0

    def update(self, sq_small, sq_large, n_small, n_large):
        est_sq_norm = (n_large * sq_large - n_small * sq_small) / (n_large - n_small)
        est_var = (sq_small - sq_large) / (1 / n_small - 1 / n_large)
        self.ema_sq_norm = self.beta * self.ema_sq_norm + (1 - self.beta) * est_sq_norm
        self.ema_var = self.beta * self.ema_var + (1 - self.beta) * est_var
        return max(self.ema_var, self.eps) / max(self.ema_sq_norm, self.eps), est_sq_norm, est_var


class FourierFeatures(nn.Module):
    def __init__(self, out: int, std: float = 1.0):
        super().__init__()
        self.register_buffer("weight", torch.randn(out // 2, 1) * std)

    def forward(self, x):
        f = 2 * math.pi * x @ self.weight.T
        return torch.cat([f.cos(), f.sin()], -1)


class TinyInner(nn.Module):
    """An image denoiser of k-diffusion's kind (``image_v1.py`` in miniature): the noise level
    ``c_noise = log(σ)/4`` through Fourier features and a mapping layer into a per-channel
    shift, around two convolutions."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.fourier, self.mapping = FourierFeatures(4), nn.Linear(4, width)
        self.proj_in, self.proj_out = (
            nn.Conv2d(1, width, 3, padding=1),
            nn.Conv2d(width, 1, 3, padding=1),
        )

    def forward(self, x, sigma):
        shift = self.mapping(self.fourier(sigma.log()[:, None] / 4))
        return self.proj_out(F.gelu(self.proj_in(x) + shift[:, :, None, None]))


class Denoiser(nn.Module):
    """k-diffusion ``k_diffusion/layers.py``'s ``Denoiser``: Karras et al.'s preconditioning,
    and its ``loss`` (a method, not the forward), each example's own weighted squared error."""

    def __init__(self, inner: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        self.inner_model, self.sigma_data = inner, sigma_data

    def get_scalings(self, sigma):
        c_skip = self.sigma_data**2 / (sigma**2 + self.sigma_data**2)
        c_out = sigma * self.sigma_data / (sigma**2 + self.sigma_data**2) ** 0.5
        c_in = 1 / (sigma**2 + self.sigma_data**2) ** 0.5
        return c_skip, c_out, c_in

    def loss(self, input, noise, sigma):
        c_skip, c_out, c_in = (x[:, None, None, None] for x in self.get_scalings(sigma))
        c_weight = (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2  # "karras"
        noised_input = input + noise * sigma[:, None, None, None]
        model_output = self.inner_model(noised_input * c_in, sigma)
        target = (input - c_skip * noised_input) / c_out
        return (model_output - target).pow(2).flatten(1).mean(1) * c_weight

    def forward(self, input, sigma):
        c_skip, c_out, c_in = (x[:, None, None, None] for x in self.get_scalings(sigma))
        return self.inner_model(input * c_in, sigma) * c_out + input * c_skip


def test_k_diffusion_gradient_noise_scale_from_per_example_norms_through_model_loss():
    """crowsonkb/k-diffusion ``train.py`` with ``--gns``: ``losses = model.loss(reals, noise,
    sigma)`` (a method of the hooked ``Denoiser``, not its forward; σ drawn per example from
    the log-normal ``sample_density``), ``accelerator.backward(losses.mean())``, then
    ``gns_stats.update(sq_norm_small_batch, sq_norm_large_batch, n_small, n_large)``. The
    script's small batches are the processes' (``DDPGradientStatsHook``); on one process
    gradhooks' per-example norms give the smallest: ``n_small = 1``, ``sq_norm_small_batch =
    mean_i ‖g_i‖²``, ``sq_norm_large_batch = ‖p.grad‖²``. Over 3 Adam steps the norms are the
    loop's, the script's two estimates are the loop's and equal ``h.noise_scale()``'s
    (``grad_sq`` and ``trace``), and the smoothed noise scale is the loop's."""
    B = 4
    torch.manual_seed(0)
    model = Denoiser(TinyInner()).to(D)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ours, theirs = GradientNoiseScale(), GradientNoiseScale()
    g = torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq")) as h:
        for _ in range(3):
            reals = torch.randn(B, 1, 4, 4, generator=g, dtype=D)
            noise = torch.randn(reals.shape, generator=g, dtype=D)
            sigma = (torch.randn(B, generator=g, dtype=D) * 1.2 - 1.2).exp()  # lognormal
            losses = model.loss(reals, noise, sigma)
            losses.mean().backward()
            norms = h.norms()
            sq_small = float((norms**2).mean())
            sq_large = float(sum(p.grad.pow(2).sum() for p in model.parameters()))
            gns, est_sq_norm, est_var = ours.update(sq_small, sq_large, 1, B)
            per = loop(twin, lambda *row: twin.loss(*row)[0], reals, noise, sigma)
            want_norms = flat(per).norm(dim=1)
            torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)
            mean = flat(per).mean(0)
            want_gns, want_sq, want_var = theirs.update(
                float((want_norms**2).mean()), float(mean.pow(2).sum()), 1, B
            )
            est = h.noise_scale()
            assert est_sq_norm == pytest.approx(want_sq, rel=1e-9)
            assert est_var == pytest.approx(want_var, rel=1e-9)
            assert float(est.grad_sq) == pytest.approx(want_sq, rel=1e-9)
            assert float(est.trace) == pytest.approx(want_var, rel=1e-9)
            assert gns == pytest.approx(want_gns, rel=1e-9)
            opt.step()
            opt.zero_grad()
            follow(twin, model)


# -- karpathy/nanoGPT: train.py ------------------------------------------------------------------


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_2, self.c_fc, self.mlp_proj = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
        )
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's flash path
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """karpathy/nanoGPT ``model.py``'s ``GPT`` in miniature: token and position embeddings,
    the language-model head tied to the token embedding, ``forward(idx, targets)`` returning
    the logits and the mean token loss, ``crop_block_size``, ``get_num_params``,
    ``configure_optimizers`` (weight decay on the parameters of 2 or more dimensions) and
    ``estimate_mfu``."""

    def __init__(self, vocab: int = 16, block_size: int = 16, d: int = 8, heads: int = 2):
        super().__init__()
        self.block_size, self.d, self.heads = block_size, d, heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h, self.ln_f = NanoBlock(d, heads), nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long)
        x = self.ln_f(self.h(self.wte(idx) + self.wpe(pos)))
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def crop_block_size(self, block_size):
        self.block_size = block_size
        self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        n, t = self.get_num_params(), self.block_size
        flops_per_iter = (
            (6 * n + 12 * 1 * self.heads * (self.d // self.heads) * t) * t * fwdbwd_per_iter
        )
        return flops_per_iter / dt / 312e12


def test_nanogpt_train_loop_cropped_accumulated_clipped_with_norms_and_noise_scale():
    """karpathy/nanoGPT ``train.py``: the model cropped (``model.crop_block_size(block_size)``,
    which puts a new ``wpe.weight`` parameter in place) after gradhooks was added, the script's
    ``configure_optimizers``, ``estimate_loss`` between the iterations (eval mode, under
    ``no_grad``), ``get_lr``'s warmup, 2 micro-steps of ``loss /
    gradient_accumulation_steps`` through ``scaler.scale(loss).backward()`` (a disabled
    ``GradScaler``: on the CPU the script's ``ctx`` is ``nullcontext()``), ``scaler.unscale_``
    and ``clip_grad_norm_``, ``scaler.step`` and ``estimate_mfu``. A user logs each example's
    gradient norm after each micro-step (``h.norms()``, times the accumulation steps) and the
    gradient noise scale of the logical batch (McCandlish et al.: ``mean_i ‖g_i‖²`` against
    ``‖p.grad‖²`` before the clipping). Over 2 iterations the norms are the loop's, ``grad1``
    after the micro-steps is each micro-batch's rows added up over the accumulation steps, the
    clipping leaves it as it was, and the noise scale's estimate of ``|G|²`` is the loop's."""
    ACC, B, T_, CLIP = 2, 3, 6, 0.5
    torch.manual_seed(0)
    model = NanoGPT().to(D)
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms"))
    model.crop_block_size(8)
    twin = copy.deepcopy(model)
    optimizer = model.configure_optimizers(0.1, 6e-3, (0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(7)
    estimates = []
    for it in range(2):
        lr = 6e-3 * (it + 1) / 2  # get_lr's linear warmup
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.eval()  # estimate_loss(): eval mode, @torch.no_grad(), then train mode again
        with torch.no_grad():
            held_out = torch.randint(16, (B, T_ + 1), generator=g)
            _, val_loss = model(held_out[:, :-1].contiguous(), held_out[:, 1:].contiguous())
        model.train()
        assert val_loss.isfinite()
        data = torch.randint(16, (ACC, B, T_ + 1), generator=g)
        xs, ys = data[..., :-1].contiguous(), data[..., 1:].contiguous()  # (get_batch's stack)
        norms = []
        for micro_step in range(ACC):
            X, Y = xs[micro_step], ys[micro_step]
            logits, loss = model(X, Y)
            loss = loss / ACC
            scaler.scale(loss).backward()
            norms.append(h.norms() * ACC)
        per = [loop(twin, lambda x, y: twin(x, y)[1], xs[m], ys[m]) for m in range(ACC)]
        want_norms = torch.cat([flat(p).norm(dim=1) for p in per])
        torch.testing.assert_close(torch.cat(norms), want_norms, rtol=1e-9, atol=1e-12)
        added = {n: sum(p[n] for p in per) / ACC for n in per[0]}
        assert_all({n: p.grad1 for n, p in trainable(model).items()}, added, f"iter {it}")
        sq_small = float((torch.cat(norms) ** 2).mean())
        sq_large = float(sum(p.grad.pow(2).sum() for p in model.parameters()))
        want_large = float(
            sum((sum(p[n].sum(0) for p in per) / (ACC * B)).pow(2).sum() for n in per[0])
        )
        assert sq_large == pytest.approx(want_large, rel=1e-9)
        n_large = ACC * B  # (|G|²'s unbiased estimate, from the small and the large batch)
        estimates.append((n_large * sq_large - sq_small) / (n_large - 1))
        want_small = float((want_norms**2).mean())
        want_est = (n_large * want_large - want_small) / (n_large - 1)
        assert estimates[-1] == pytest.approx(want_est, rel=1e-9, abs=1e-15)
        scaler.unscale_(optimizer)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert float(total) == pytest.approx(math.sqrt(want_large), rel=1e-9)
        assert_all({n: p.grad1 for n, p in trainable(model).items()}, added, f"iter {it} clipped")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        assert model.estimate_mfu(B * ACC, 1.0) > 0
        follow(twin, model)
    h.remove()
    assert model.wpe.weight.shape == (8, 8) and len(estimates) == 2


# -- microsoft/dp-transformers: nlg-reddit, sample level and author level ------------------------


def reddit_like(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` posts tokenized as the script does (``padding="max_length"``), of unequal
    lengths: ``input_ids`` and ``attention_mask``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).long()
    return [{"input_ids": ids[i] * mask[i], "attention_mask": mask[i]} for i in range(n)]


def private_causal_collator(examples: list[dict]) -> dict[str, torch.Tensor]:
    """dp-transformers' ``DataCollatorForPrivateCausalLanguageModeling``: the language-model
    collator's labels (-100 on the padding) and explicit ``position_ids``,
    ``torch.arange(T).repeat(batch, 1)``, for Opacus to find the batch in."""
    batch = {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    ids = batch["input_ids"]
    batch["position_ids"] = torch.arange(ids.shape[1], dtype=torch.long).repeat(ids.shape[0], 1)
    return batch


def own_mean_token_loss(model, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """One sequence's own loss, run alone: its next-token cross-entropy averaged over its own
    labelled tokens."""
    labels = row["labels"]
    logits = model(**{k: v for k, v in row.items() if k != "labels"}).logits
    return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (transformers' own deprecations)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
def test_dp_transformers_nlg_reddit_lora_through_the_trainer_with_position_ids(
    tmp_path, checkpointing
):
    """microsoft/dp-transformers ``examples/nlg-reddit/sample-level-dp/fine-tune-dp.py`` with
    ``--lora_dim``: GPT-2 with LoRA on the attention's ``c_attn``, only the adapter trainable
    (``mark_only_lora_as_trainable``), its ``DataCollatorForPrivateCausalLanguageModeling``
    (explicit ``position_ids`` in every batch) and the Hugging Face ``Trainer`` made private
    (``OpacusDPTrainer``), here ``gradhooks.hf.DPTrainer`` with PEFT's ``LoraConfig`` and the
    script's collator. Over 2 Trainer steps of 2 accumulated physical batches, each update is
    the float64 loop's: each drawn sequence's own mean token loss run alone (with its
    position ids), its gradient clipped, summed, over the expected batch size, times the
    rate of plain SGD; the base model's weights do not move. Also with
    ``--gradient_checkpointing`` (the Trainer's own: each block's forward run again in the
    backward)."""
    transformers = transformers_or_skip()
    peft = pytest.importorskip("peft")
    pytest.importorskip("dp_accounting")
    from gradhooks.hf import DPArguments, DPTrainer

    base = tiny_gpt2()
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                        fan_in_fan_out=True),
    )  # fmt: skip
    model.to(D)
    frozen = base.transformer.h[0].attn.c_attn.weight.detach().clone()
    twin = copy.deepcopy(model)
    clip, lr, per_device, acc = 0.05, 0.5, 2, 2
    checked = []

    class Checked(DPTrainer):
        def per_example_losses(self, model, inputs):
            self.rows += [
                {k: v[i : i + 1] for k, v in inputs.items()} for i in range(len(inputs["labels"]))
            ]
            return super().per_example_losses(model, inputs)

    class Against(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer.rows = []
            follow(twin, model)
            self.before = {n: p.detach().clone() for n, p in trainable(model).items()}

        def on_step_end(self, args, state, control, **kwargs):
            rows = trainer.rows
            assert rows and all("position_ids" in r for r in rows)
            per = {n: torch.stack(g) for n, g in zip(
                trainable(twin),
                zip(*(torch.autograd.grad(own_mean_token_loss(twin, r), list(trainable(twin).values()))
                      for r in rows)),
            )}  # fmt: skip
            want = {n: -lr * s / (per_device * acc) for n, s in clipped_sum(per, clip).items()}
            got = {n: p.detach() - self.before[n] for n, p in trainable(model).items()}
            assert_all(got, want, f"step {state.global_step}", rtol=1e-7, atol=1e-12)
            norms = flat(per).norm(dim=1)
            checked.append((len(rows), bool((norms > clip).any() and (norms < clip).any())))

    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=acc, max_steps=2, optim="sgd", learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0,
        remove_unused_columns=False, gradient_checkpointing=checkpointing,
    )  # fmt: skip
    dp = DPArguments(max_grad_norm=clip, delta=1e-5, noise_multiplier=0.0, sampling_seed=1)
    trainer = Checked(
        model, args, train_dataset=reddit_like(16), data_collator=private_causal_collator, dp=dp,
        callbacks=[Against()],
    )  # fmt: skip
    trainer.train()
    assert len(checked) == 2 and all(n > 0 for n, _ in checked), checked
    assert any(mixed for _, mixed in checked), "no step both clipped and left some unclipped"
    assert torch.equal(base.transformer.h[0].attn.c_attn.weight, frozen)
    assert base.transformer.gradient_checkpointing == checkpointing


# -- huggingface/transformers: run_glue_no_trainer.py under accelerate, bfloat16 ----------------


@pytest.fixture
def accelerate():
    """The accelerate module, its process-wide state reset before and after the test (an
    ``Accelerator`` of another mixed precision is refused while one exists)."""
    module = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield module
    AcceleratorState._reset_state(True)


def padded_to_longest(examples: list[dict]) -> dict[str, torch.Tensor]:
    """``DataCollatorWithPadding``: each batch right-padded to its own longest sequence."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])], mask[i, : len(e["input_ids"])] = e["input_ids"], 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.stack([e["label"] for e in examples]),
    }


BF16 = 0.04  # bfloat16: 8 significant bits, 2^-8 = 0.4% per rounding, ~1% through a block


def test_run_glue_no_trainer_accelerate_bf16_norms_per_micro_batch_and_eval_with_graphs(
    accelerate,
):
    """huggingface/transformers ``examples/pytorch/text-classification/run_glue_no_trainer.py``
    as first published: ``accelerator.prepare(model, optimizer, train_dataloader,
    eval_dataloader)`` (here with ``mixed_precision="bf16"``, the forward under bfloat16
    autocast), dynamic padding, AdamW with the decay groups, ``loss = outputs.loss /
    gradient_accumulation_steps``, ``accelerator.backward(loss)``, the step when ``step %
    gradient_accumulation_steps == 0`` (so after the first batch alone, then after pairs) or at
    the loader's end, and the evaluation in eval mode *without* ``no_grad`` (graphs built and
    never backpropagated). The user adds gradhooks after ``prepare`` and logs each example's
    gradient norm after every ``accelerator.backward`` (``h.norms()``, each backward's own).
    Over 2 epochs (3 optimizer steps each), at every backward the norms times the accumulation
    steps are the float64 loop's own gradient norms within bfloat16's rounding (measured 2e-3
    of the largest; tolerance 4e-2, as for the other bfloat16 checks), ``grad1`` holds
    each example's rows added up over the micro-batches since the last step (each example's
    whole gradient within the same rounding of its norm: measured 3e-3), and its mean is torch's ``.grad``
    (its weight gradients bfloat16 products too) within one bfloat16 rounding (measured
    8e-4 of the whole gradient's norm; tolerance 1e-2)."""
    transformers = transformers_or_skip()
    from harness import tiny_bert_config

    ACC = 2
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_bert_config(num_labels=3))
    twin = copy.deepcopy(model).to(D)
    g = torch.Generator().manual_seed(0)
    train = [
        {"input_ids": torch.randint(1, 20, (int(n),), generator=g), "label": torch.randint(3, (), generator=g)}
        for n in torch.randint(3, 9, (7,), generator=g)
    ]  # fmt: skip
    groups = decay_groups(model)
    loader = torch.utils.data.DataLoader(train, batch_size=2, collate_fn=padded_to_longest)
    evaluation = torch.utils.data.DataLoader(train, batch_size=4, collate_fn=padded_to_longest)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer, loader, evaluation = accelerator.prepare(
        model, torch.optim.AdamW(groups, lr=1e-2), loader, evaluation
    )
    steps, held = 0, None
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for epoch in range(2):
            model.train()
            for step, batch in enumerate(loader):
                outputs = model(**batch)
                loss = outputs.loss / ACC
                accelerator.backward(loss)
                per = loop(
                    twin,
                    lambda ids, mask, y: F.cross_entropy(
                        twin(input_ids=ids, attention_mask=mask).logits, y
                    ),
                    batch["input_ids"], batch["attention_mask"], batch["labels"],
                )  # fmt: skip
                own = flat(per).norm(dim=1)
                err = float((h.norms().double() * ACC - own).abs().max() / own.max())
                assert err < BF16, f"epoch {epoch} batch {step}: norms off by {err:.3f}"
                held = {n: w / ACC + (held[n] if held else 0) for n, w in per.items()}
                rows = flat({n: p.grad1.double() for n, p in trainable(model).items()})
                err = float(((rows - flat(held)).norm(dim=1) / flat(held).norm(dim=1)).max())
                assert err < BF16, f"epoch {epoch} batch {step}: grad1 off by {err:.3f}"
                summed = torch.cat([p.grad.flatten() for p in trainable(model).values()])
                err = float((rows.mean(0) - summed.double()).norm() / summed.norm())
                assert err < 1e-2, f"epoch {epoch} batch {step}: grad1's mean off by {err:.4f}"
                if step % ACC == 0 or step == len(loader) - 1:
                    optimizer.step()
                    optimizer.zero_grad()
                    steps, held = steps + 1, None
                    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            model.eval()
            for batch in evaluation:
                predictions = model(**batch).logits.argmax(dim=-1)
                assert predictions.shape == batch["labels"].shape
    assert steps == 6


# -- lxuechen/private-transformers: prompt-based classification ----------------------------------


class RobertaForPromptFinetuning(nn.Module):
    """private-transformers ``examples/classification/src/models.py``'s
    ``RobertaForPromptFinetuning``: the encoder, the ``<mask>`` token's representation picked
    per example (``sequence_output[torch.arange(batch_size), mask_pos]``), the masked-language
    head (its decoder the word embedding, tied) and the logits of the label words."""

    def __init__(self, config, label_word_list):
        super().__init__()
        transformers = transformers_or_skip()
        from transformers.models.roberta.modeling_roberta import RobertaLMHead

        self.roberta = transformers.RobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.lm_head.decoder.weight = self.roberta.embeddings.word_embeddings.weight
        self.label_word_list = label_word_list

    def forward(self, input_ids, attention_mask, mask_pos):
        mask_pos = mask_pos.squeeze()  # (as written: a batch of one gives a 0-d position)
        sequence_output = self.roberta(input_ids, attention_mask=attention_mask)[0]
        sequence_mask_output = sequence_output[torch.arange(input_ids.size(0)), mask_pos]
        prediction_mask_scores = self.lm_head(sequence_mask_output)
        logits = [prediction_mask_scores[:, w].unsqueeze(-1) for w in self.label_word_list]
        return torch.cat(logits, -1)


def prompts(g: torch.Generator, n: int, mask_id: int = 3):
    """``<s> sentence <mask> . </s>`` prompts (the template ``*cls**sent_0*_It_was*mask*.*sep+*``)
    of unequal lengths, right-padded: the ids, the attention mask, each ``<mask>``'s
    position, ``[n, 1]``, and the labels."""
    lengths = torch.randint(2, 6, (n,), generator=g)
    ids = torch.ones(n, 9, dtype=torch.long)  # (1: RoBERTa's padding id)
    for i, k in enumerate(lengths.tolist()):
        ids[i, : k + 4] = torch.tensor(
            [0, *torch.randint(5, 30, (k,), generator=g).tolist(), mask_id, 4, 2]
        )
    return ids, (ids != 1).long(), (lengths + 1)[:, None], torch.randint(2, (n,), generator=g)


def test_private_transformers_prompt_classification_frozen_tied_embedding_ghost_clipping():
    """lxuechen/private-transformers ``examples/classification/run_classification.py`` with
    ``RobertaForPromptFinetuning``: SST-2 as a cloze (``It was <mask>.``, the label words
    "terrible"/"great"), the logits of the label words at each example's ``<mask>``, the
    trainer's per-example cross-entropy handed to the engine's ``step(loss=...)`` in ghost
    clipping, and ``--static_embedding`` (the word embedding frozen: so is the language-model
    head's decoder, the same tensor, while its bias trains). Here ``dp_sgd_step(method=
    "ghost")`` with SGD, 2 steps: each ``.grad``, the noise taken off, is the loop's clipped
    sum over the batch; the frozen embedding gets none and does not move."""
    transformers = transformers_or_skip()
    C, SIGMA, B = 1.0, 0.7, 4
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=12, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1,
    )  # fmt: skip
    model = RobertaForPromptFinetuning(config, label_word_list=[11, 17]).to(D)
    model.roberta.embeddings.word_embeddings.requires_grad_(False)  # --static_embedding
    frozen = model.lm_head.decoder.weight.detach().clone()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    noise, again = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    g = torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(2):
            ids, mask, mask_pos, labels = prompts(g, B)
            opt.zero_grad()
            losses = F.cross_entropy(model(ids, mask, mask_pos), labels, reduction="none")
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=C, noise_multiplier=SIGMA, generator=noise, method="ghost"
            )
            per = loop(
                twin,
                lambda *row: F.cross_entropy(twin(*row[:3]), row[3]),
                ids, mask, mask_pos, labels,
            )  # fmt: skip
            torch.testing.assert_close(norms, flat(per).norm(dim=1))
            assert (norms > C).any() and (norms < C).any(), norms
            got = denoised(model, again, SIGMA * C, B)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            opt.step()
            follow(twin, model)
    assert torch.equal(model.lm_head.decoder.weight, frozen)
    assert model.lm_head.decoder.weight.grad is None
    assert "lm_head.bias" in trainable(model) or "lm_head.decoder.bias" in trainable(model)


# -- K-FAC: kfac-pytorch's vision engine -----------------------------------------------------


class KfacNet(nn.Module):
    """A convolution and a linear head (kfac-pytorch's ResNets in miniature: the layers K-FAC
    preconditions, a Conv2d whose positions are shared and a Linear)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def own_factors(model: KfacNet, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The empirical K-FAC factors by a loop over the examples, each run alone: its layers'
    inputs (a convolution's patches, each a row; a ones column for the bias) and the
    gradients of its own loss at their outputs; ``A`` the mean of ``a aᵀ`` over the examples
    and positions, ``G`` the sum of ``g gᵀ`` over the positions, averaged over the examples
    (gradhooks' ``expand=True``, ``reduction="mean"``)."""
    sums = {"conv.weight": [0, 0], "fc.weight": [0, 0]}
    n = len(x)
    for i in range(n):
        seen = {}
        hooks = [
            m.register_forward_hook(lambda m, inp, out, k=k, s=seen: s.update({k: (inp[0], out)}))
            for k, m in (("conv.weight", model.conv), ("fc.weight", model.fc))
        ]
        try:
            with gradhooks.paused():
                out = model(x[i : i + 1])
                loss = F.cross_entropy(out, y[i : i + 1])
                outs = [seen[k][1] for k in sums]
                grads = torch.autograd.grad(loss, outs)
        finally:
            for h in hooks:
                h.remove()
        for (k, (inp, _)), g in zip(seen.items(), grads, strict=True):
            if k == "conv.weight":
                a = F.unfold(inp, 3)[0].T  # [positions, in·3·3]
                g = g[0].flatten(1).T  # [positions, out]
            else:
                a, g = inp, g
            a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
            sums[k][0] = sums[k][0] + a.T @ a / (n * len(a))
            sums[k][1] = sums[k][1] + g.T @ g / n
    return sums


def test_kfac_pytorch_engine_accumulated_batches_with_running_factors():
    """gpauloski/kfac-pytorch ``examples/vision/engine.py``'s ``train``: each step over
    ``batches_per_allreduce`` loader batches, ``loss = loss_func(output, target) /
    batches_per_allreduce`` and its backward on each, then ``preconditioner.step()``
    (``KFACPreconditioner``: factors from the
    training batch every ``factor_update_steps``, a running average of decay
    ``factor_decay``, inverses every ``inv_update_steps``) and ``optimizer.step()`` (SGD with
    momentum). Here ``gradhooks.KFAC(fisher="empirical")`` around the SGD, ``opt.step(data,
    target)`` after the accumulated batches. Over 3 steps (factors at every step, inverses at steps
    0 and 2) the weights are those of a float64 twin preconditioned by hand: the factors from
    each example's own inputs and output-gradients by a loop, averaged as the script does,
    each weight's gradient (its bias a column) solved against ``kron(G, A) + damping·I``
    with the factors last inverted."""
    MINI, B, DAMPING, DECAY = 2, 6, 1e-2, 0.95
    torch.manual_seed(0)
    model = KfacNet().to(D)
    twin = copy.deepcopy(model)
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), damping=DAMPING,
        decay=DECAY, factors_every=1, inverse_every=2, fisher="empirical",
    )  # fmt: skip
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    running, inverted = None, None
    for step in range(3):
        data = torch.randn(B, 1, 6, 6, generator=g, dtype=D)
        target = torch.randint(4, (B,), generator=g)
        opt.zero_grad()
        for i in range(0, B, B // MINI):
            output = model(data[i : i + B // MINI])
            loss = F.cross_entropy(output, target[i : i + B // MINI]) / MINI
            loss.backward()
        opt.step(data, target)
        new = own_factors(twin, data, target)
        running = new if running is None else {
            k: [DECAY * r + (1 - DECAY) * f for r, f in zip(running[k], new[k], strict=True)]
            for k in new
        }  # fmt: skip
        if step % 2 == 0:
            inverted = {k: [t.clone() for t in v] for k, v in running.items()}
        twin_opt.zero_grad()
        F.cross_entropy(twin(data), target).backward()
        for k, layer in (("conv.weight", twin.conv), ("fc.weight", twin.fc)):
            A, G = inverted[k]
            grad = torch.cat([layer.weight.grad.flatten(1), layer.bias.grad[:, None]], 1)
            eye = torch.eye(grad.numel(), dtype=D)
            natural = torch.linalg.solve(torch.kron(G, A) + DAMPING * eye, grad.flatten())
            natural = natural.view(grad.shape)
            layer.weight.grad = natural[:, :-1].reshape(layer.weight.shape).clone()
            layer.bias.grad = natural[:, -1].clone()
        twin_opt.step()
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=f"step {step}: {n}")
        assert set(opt.factors) == set(running)
        for k, f in opt.factors.items():
            torch.testing.assert_close(f.A, running[k][0], rtol=1e-9, atol=1e-12, msg=k)
            torch.testing.assert_close(f.G, running[k][1], rtol=1e-9, atol=1e-12, msg=k)


# -- princeton-nlp/LESS: Adam-preconditioned LoRA gradient features for data selection -----------


def adam_features(grads: torch.Tensor, avg: torch.Tensor, avg_sq: torch.Tensor) -> torch.Tensor:
    """LESS's ``obtain_gradients_with_adam``: the gradient through one more Adam update of the
    checkpoint's moments, ``m' / sqrt(v' + eps)`` (row by row)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-08
    updated_avg = beta1 * avg + (1 - beta1) * grads
    updated_avg_sq = beta2 * avg_sq + (1 - beta2) * grads**2
    return updated_avg / torch.sqrt(updated_avg_sq + eps)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (transformers' own deprecations)
def test_less_adam_lora_gradient_features_select_the_same_data_as_its_batch_of_one_loop():
    """princeton-nlp/LESS ``less/data_selection/collect_grad_reps.py`` and ``matching.py``:
    after a LoRA warm-up with AdamW, each training example's gradient of the LoRA weights at
    each checkpoint, one example per batch (``model(**batch).loss``, its own mean token loss;
    the functorch version "never made it work sadly"), turned into an Adam update direction
    with the checkpoint's moments (``obtain_gradients_with_adam``), each validation example's
    plain gradient (``obtain_gradients``), a Rademacher projection (trak's
    ``BasicProjector``), normalized rows, scores ``train @ valid.T`` weighted by the
    checkpoints' learning rates, averaged over each target subtask's examples and maxed over
    the subtasks. Here one backward per batch of the examples' own losses (gradhooks.hf's
    ``per_example_loss``, summed, ``loss_reduction="sum"``): the features, the scores and the
    selected examples are the script's loop's, at 2 checkpoints (within float32's rounding:
    Hugging Face's ``.loss`` takes the logits to float32, ``logits.float()``, so the script's
    own gradients are float32's: measured 6e-8 of each row's norm)."""
    transformers_or_skip()
    peft = pytest.importorskip("peft")
    from gradhooks.hf import per_example_loss

    model = peft.get_peft_model(
        tiny_gpt2(),
        peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                        fan_in_fan_out=True),
    )  # fmt: skip
    model.to(D)
    names = list(trainable(model))
    assert names and all("lora" in n for n in names)  # (LESS's get_number_of_params check)
    g = torch.Generator().manual_seed(3)
    train = reddit_like(6, seed=4)
    valid = reddit_like(4, seed=5)  # 2 subtasks of 2 examples
    batch_of = lambda rows: private_causal_collator(rows)  # noqa: E731
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    checkpoints = []
    for lr in (1e-2, 5e-3):  # the warm-up, a checkpoint after each step
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randperm(6, generator=g)[:4].tolist()
        opt.zero_grad()
        model(**batch_of([train[i] for i in idx])).loss.backward()
        opt.step()
        state = opt.state_dict()["state"]
        avg = torch.cat([state[k]["exp_avg"].flatten() for k in range(len(names))])
        avg_sq = torch.cat([state[k]["exp_avg_sq"].flatten() for k in range(len(names))])
        weights = {n: p.detach().clone() for n, p in trainable(model).items()}
        checkpoints.append((weights, avg, avg_sq, lr))
    total = sum(p.numel() for p in trainable(model).values())
    projection = torch.randint(2, (total, 16), generator=g).to(D) * 2 - 1  # Rademacher

    def script(rows, avg=None, avg_sq=None):
        """The script's loop: one example per batch, ``model(**batch).loss``, ``.grad``."""
        feats = []
        with gradhooks.paused():
            for row in rows:
                model.zero_grad()
                model(**batch_of([row])).loss.backward()
                grads = torch.cat([p.grad.view(-1) for p in trainable(model).values()])
                feats.append(grads if avg is None else adam_features(grads, avg, avg_sq))
        model.zero_grad()
        return torch.stack(feats)

    def hooked(h, rows, avg=None, avg_sq=None):
        """One backward of the batch's own losses, every example's gradient from grad1."""
        batch = batch_of(rows)
        labels = batch.pop("labels")
        model.zero_grad()
        per_example_loss(model(**batch).logits, labels, shift=True).sum().backward()
        grads = torch.cat([p.grad1.flatten(1) for p in trainable(model).values()], 1)
        return grads if avg is None else adam_features(grads, avg, avg_sq)

    scores = {"script": 0, "gradhooks": 0}
    lrs = sum(c[3] for c in checkpoints)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for weights, avg, avg_sq, lr in checkpoints:
            with torch.no_grad():
                for n, p in trainable(model).items():
                    p.copy_(weights[n])
            train_s, valid_s = script(train, avg, avg_sq), script(valid)
            train_h, valid_h = hooked(h, train, avg, avg_sq), hooked(h, valid)
            for what, ours, theirs in (("adam", train_h, train_s), ("sgd", valid_h, valid_s)):
                err = float(((ours - theirs).norm(dim=1) / theirs.norm(dim=1)).max())
                assert err < 1e-5, f"{what} features off by {err:.2e}"  # (float32's 6e-8)
            for way, (tr, va) in (
                ("script", (train_s, valid_s)),
                ("gradhooks", (train_h, valid_h)),
            ):
                tr, va = F.normalize(tr @ projection, dim=1), F.normalize(va @ projection, dim=1)
                scores[way] = scores[way] + lr / lrs * (tr @ va.T)
    got, want = (scores[w].reshape(6, 2, -1).mean(-1).max(-1)[0] for w in ("gradhooks", "script"))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.topk(3).indices.tolist() == want.topk(3).indices.tolist()
    assert len(set(got.tolist())) == 6


class ScaledStdConv2d(nn.Conv2d):
    """TAN ``src/models/NFnet.py``'s ``MyScaledStdConv2d`` (from timm): a Conv2d subclass whose
    forward standardizes its weight over each output channel's fan-in and scales it by a
    learned ``gain`` before ``F.conv2d``."""

    def __init__(self, cin, cout, k, gain_init=1.0, eps=1e-6):
        super().__init__(cin, cout, k, padding=k // 2)
        self.gain = nn.Parameter(torch.full((cout, 1, 1, 1), gain_init))
        self.eps = eps

    def forward(self, x):
        fan_in = self.weight[0].numel()
        mean = torch.mean(self.weight, dim=[-3, -2, -1], keepdim=True)
        var = torch.var(self.weight, dim=[-3, -2, -1], keepdim=True)
        std_weight = (self.weight - mean) / (var * fan_in + self.eps) ** 0.5 * self.gain
        return F.conv2d(x, std_weight, self.bias, self.stride, self.padding)


class Expand(nn.Module):
    """TAN's ``Expand``: the skip-init gain, one parameter expanded over the batch."""

    def __init__(self, tensor):
        super().__init__()
        self.weight = nn.Parameter(tensor)

    def forward(self, x):
        return self.weight.unsqueeze(0).expand([x.size(0)] + [-1] * self.weight.ndim)


class NormFreeNet(nn.Module):
    """A stem and one of TAN's ``MyNormFreeBlock`` (pre-activation ``act1(x) * beta``, a 1x1,
    a 3x3 and a 1x1 weight-standardized convolution, in-place activations, the skip-init
    ``Expand`` gain, ``out * alpha + shortcut``), pooled into a linear head."""

    def __init__(self, width=4, classes=3, alpha=0.2, beta=1.0):
        super().__init__()
        self.stem = ScaledStdConv2d(3, width, 3)
        self.act1, self.conv1 = nn.GELU(), ScaledStdConv2d(width, 2, 1)
        self.act2, self.conv2 = nn.ReLU(inplace=True), ScaledStdConv2d(2, 2, 3)
        self.act3, self.conv3 = nn.ReLU(inplace=True), ScaledStdConv2d(2, width, 1, gain_init=1.0)
        self.expand = Expand(torch.tensor(1.0))
        self.head = nn.Linear(width, classes)
        self.alpha, self.beta = alpha, beta

    def forward(self, x):
        x = self.stem(x)
        out = self.act1(x) * self.beta
        out = self.conv3(self.act3(self.conv2(self.act2(self.conv1(out)))))
        out = out * self.expand(out).unsqueeze(1).unsqueeze(2).unsqueeze(3)
        out = out * self.alpha + x
        return self.head(out.mean((2, 3)))


def test_tan_nfnet_weight_standardized_convolutions_and_skipinit_gain_with_views():
    """facebookresearch/tan ``src/models/NFnet.py``, the NFNet that ``imagenet.py`` trains with
    augmentation multiplicity: ``MyScaledStdConv2d`` (a Conv2d subclass whose own forward
    standardizes the weight and multiplies a ``gain``; TAN registers a grad sampler that
    backpropagates the convolution's per-sample gradient through the standardization) and
    ``Expand`` (the skip-init gain, a parameter ``expand``-ed over the batch: TAN's sampler
    returns its backprops as they are). With gradhooks nothing is registered: over 2 DP-SGD
    steps (SGD, each example's gradient the mean over its 2 views, clipped) ``.grad``, the
    noise taken off, is the loop's clipped sum, and the logged norms the loop's."""
    C, SIGMA, B, K = 1.1, 0.6, 3, 2
    torch.manual_seed(0)
    model = Views(NormFreeNet()).to(D)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    noise, again = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    seen = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(2):
            views = augment(torch.randn(B, 3, 6, 6, generator=g, dtype=D), K, g)
            target = torch.randint(3, (B,), generator=g)
            opt.zero_grad()
            out = model(views)
            losses = F.cross_entropy(
                out.flatten(0, 1), target.repeat_interleave(K), reduction="none"
            )
            norms = gradhooks.dp_sgd_step(
                h, losses.view(B, K).mean(1), max_norm=C, noise_multiplier=SIGMA, generator=noise
            )
            per = loop(twin, lambda v, t: F.cross_entropy(twin(v)[0], t.repeat(K)), views, target)
            torch.testing.assert_close(norms, flat(per).norm(dim=1))
            seen.append(norms)
            got = denoised(model, again, SIGMA * C, B)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            opt.step()
            follow(twin, model)
    assert (torch.cat(seen) > C).any() and (torch.cat(seen) < C).any(), seen


class AuthorSampler:
    """dp-transformers ``dp_transformers/sampler.py``'s ``AuthorSampler``: for each batch of
    authors its sampler draws, the next example of each author in turn (one per author)."""

    def __init__(self, author_sampler, author_mapping):
        self.author_mapping, self.author_sampler = list(author_mapping), author_sampler
        self.indices = [0 for _ in range(len(self.author_mapping))]

    def __len__(self):
        return len(self.author_sampler)

    def __iter__(self):
        for batch_author_ids in self.author_sampler:
            sample_ids = [self.indices[a] for a in batch_author_ids]
            for a in batch_author_ids:
                self.indices[a] = (self.indices[a] + 1) % len(self.author_mapping[a])
            yield [int(self.author_mapping[a][s]) for a, s in zip(batch_author_ids, sample_ids)]


def test_dp_transformers_author_level_dp_one_example_per_sampled_author(tmp_path):
    """microsoft/dp-transformers ``examples/nlg-reddit/author-level-dp/fine-tune-dp.py``: the
    posts grouped by author (``author_mapping``), authors drawn by Poisson sampling
    (``PoissonAuthorSampler``: each author with probability ``q``), one post of each drawn
    author per batch (``AuthorSampler``), so that clipping each example bounds each author's
    contribution to a step; the model fine-tuned whole (``fuft``) with AdamW. Here
    ``gradhooks.PoissonSampler`` over the authors as the author sampler, the script's
    collator, and ``gradhooks.DPOptimizer`` with the expected batch ``q·authors`` and the
    accountant. Over 3 steps (an empty draw among them: GPT-2 cannot run a batch of 0 rows, so
    one post stands in, its losses times 0, as ``gradhooks.hf.DPTrainer`` does it, which the
    refusal of an empty tensor of losses now says) every
    batch holds at most one post
    per author, ``.grad``, the noise taken off, is the loop's clipped sum of each post's own
    mean token loss over the expected batch, and the accountant recorded 3 steps at rate
    ``q``."""
    transformers_or_skip()
    pytest.importorskip("dp_accounting")
    from gradhooks.hf import per_example_loss

    C, SIGMA = 0.5, 0.8
    posts = reddit_like(10, seed=6)
    author_mapping = [[0, 3, 7], [1, 8], [2], [4, 5, 9], [6]]
    authors = gradhooks.PoissonSampler(
        len(author_mapping), 2.5, steps=4, generator=torch.Generator().manual_seed(1)
    )
    batches = list(AuthorSampler(authors, author_mapping))
    batches[1] = []  # (a draw of no author, which Poisson sampling may give)
    assert batches[0] and batches[2]
    model = tiny_gpt2(1)
    twin = copy.deepcopy(model)
    noise, again = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    accountant = gradhooks.PrivacyAccountant()
    owner = {i: a for a, ids in enumerate(author_mapping) for i in ids}
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), h, max_grad_norm=C,
            noise_multiplier=SIGMA, expected_batch_size=authors.expected_batch_size,
            sample_rate=authors.sample_rate, accountant=accountant, generator=noise,
        )  # fmt: skip
        for step, idx in enumerate(batches[:3]):
            assert len({owner[i] for i in idx}) == len(idx)  # one post per author
            batch = private_causal_collator([posts[i] for i in idx]) if idx else None
            if idx:
                labels = batch.pop("labels")
                dp.backward(per_example_loss(model(**batch).logits, labels, shift=True))
                rows = private_causal_collator([posts[i] for i in idx])
                keys = list(rows)
                per = loop(
                    twin,
                    lambda *r, k=keys: own_mean_token_loss(twin, dict(zip(k, r))),
                    *rows.values(),
                )
                want = clipped_sum(per, C)
            else:  # (GPT-2 cannot run 0 rows: no forward, the losses of no example)
                assert dp.backward(torch.zeros(0, dtype=D)).shape == (0,)
                assert dp.examples == 0
                want = {n: torch.zeros_like(p) for n, p in trainable(twin).items()}
            dp.step()
            got = denoised(model, again, SIGMA * C, authors.expected_batch_size)
            assert_all(got, want, f"step {step}", rtol=1e-9, atol=1e-11)
            dp.zero_grad()
            follow(twin, model)
    assert accountant.steps == 3
    assert {q for _, q, _ in accountant.history} == {authors.sample_rate}


def test_an_empty_draw_handed_to_the_dp_optimizer_without_a_forward_steps_on_the_noise():
    """dp-transformers' ``PoissonAuthorSampler`` (or ``gradhooks.PoissonSampler``) may draw
    no author; GPT-2 cannot run a batch of 0 rows (its attention's ``reshape(0, T, -1, d)``),
    so the loop has no losses to hand over but an empty tensor. The step it would take, by the
    float64 loop, is the noise alone over the expected batch size."""
    transformers_or_skip()
    model = tiny_gpt2(1)
    noise, again = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        dp = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=0.5,
            noise_multiplier=0.8, expected_batch_size=2.5, generator=noise,
        )  # fmt: skip
        dp.backward(torch.zeros(0, dtype=D))
        dp.step()
        got = denoised(model, again, 0.8 * 0.5, 2.5)
        assert_all(got, {n: torch.zeros_like(p) for n, p in trainable(model).items()}, "empty")


# -- crowsonkb/k-diffusion: the image transformer v2 ----------------------------------------------


def linear_geglu(x, weight, bias=None):
    x = x @ weight.mT
    if bias is not None:
        x = x + bias
    x, gate = x.chunk(2, dim=-1)
    return x * F.gelu(gate)


def rms_norm(x, scale, eps):
    mean_sq = torch.mean(x**2, dim=-1, keepdim=True)
    return x * (scale * torch.rsqrt(mean_sq + eps))


def scale_for_cosine_sim(q, k, scale, eps):
    sqrt_scale = torch.sqrt(scale)
    scale_q = sqrt_scale * torch.rsqrt(torch.sum(q**2, dim=-1, keepdim=True) + eps)
    scale_k = sqrt_scale * torch.rsqrt(torch.sum(k**2, dim=-1, keepdim=True) + eps)
    return q * scale_q, k * scale_k


def apply_rotary_emb(x, cos, sin):
    ro_dim = cos.shape[-1] * 2
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    x1, x2 = x[..., :ro_dim].chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat([x[..., :ro_dim] * cos + rotated * sin, x[..., ro_dim:]], dim=-1)


class ApplyRotaryEmbeddingInplace(torch.autograd.Function):
    """k-diffusion's in-place rotary embedding: the forward copies the rotated tensor into its
    input, the backward rotates the gradient back."""

    @staticmethod
    def forward(x, cos, sin):
        return x.copy_(apply_rotary_emb(x, cos, sin))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, grad_output):
        cos, sin = ctx.saved_tensors
        return apply_rotary_emb(grad_output, cos, -sin), None, None


class LinearGEGLU(nn.Linear):
    """A Linear subclass whose own forward is a linear and a GEGLU (``linear_geglu``)."""

    def __init__(self, cin, cout, bias=True):
        super().__init__(cin, cout * 2, bias=bias)

    def forward(self, x):
        return linear_geglu(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, shape, eps=1e-6):
        super().__init__()
        self.eps, self.scale = eps, nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return rms_norm(x, self.scale, self.eps)


class AdaRMSNorm(nn.Module):
    """An RMS norm whose scale is ``1 +`` a linear map of each example's conditioning."""

    def __init__(self, features, cond_features, eps=1e-6):
        super().__init__()
        self.eps, self.linear = eps, nn.Linear(cond_features, features, bias=False)

    def forward(self, x, cond):
        return rms_norm(x, self.linear(cond)[:, None, None, :] + 1, self.eps)


class AxialRoPE(nn.Module):
    def __init__(self, dim):
        super().__init__()
        freqs = torch.linspace(math.log(math.pi), math.log(10.0 * math.pi), dim // 4 + 1)[:-1].exp()
        self.register_buffer("freqs", freqs)

    def forward(self, pos):
        freqs = torch.cat((pos[..., 0:1] * self.freqs, pos[..., 1:2] * self.freqs), dim=-1)
        return freqs.cos(), freqs.sin()


class SelfAttentionBlock(nn.Module):
    """``image_transformer_v2.py``'s global ``SelfAttentionBlock`` (its non-flash path):
    AdaRMSNorm, a packed ``qkv_proj``, cosine-similarity attention with a learned per-head
    ``scale`` used by the block itself, the in-place axial RoPE on q and k, SDPA."""

    def __init__(self, d_model, d_head, cond_features):
        super().__init__()
        self.d_head, self.n_heads = d_head, d_model // d_head
        self.norm = AdaRMSNorm(d_model, cond_features)
        self.qkv_proj = nn.Linear(d_model, d_model * 3, bias=False)
        self.scale = nn.Parameter(torch.full([self.n_heads], 10.0))
        self.pos_emb = AxialRoPE(d_head // 2)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, pos, cond):
        skip = x
        n, h, w, _ = x.shape
        qkv = self.qkv_proj(self.norm(x, cond))
        cos, sin = self.pos_emb(pos.reshape(h * w, 2).to(qkv.dtype))
        # rearrange(qkv, "n h w (t nh e) -> t n nh (h w) e")
        q, k, v = qkv.reshape(n, h * w, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        q, k = scale_for_cosine_sim(q, k, self.scale[:, None, None] * k.shape[-1] ** 0.5, 1e-6)
        q = ApplyRotaryEmbeddingInplace.apply(q, cos, sin)
        k = ApplyRotaryEmbeddingInplace.apply(k, cos, sin)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.permute(0, 2, 1, 3).reshape(n, h, w, -1)  # "n nh (h w) e -> n h w (nh e)"
        return self.out_proj(x) + skip


class FeedForwardBlock(nn.Module):
    def __init__(self, d_model, d_ff, cond_features):
        super().__init__()
        self.norm = AdaRMSNorm(d_model, cond_features)
        self.up_proj = LinearGEGLU(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x, cond):
        return self.down_proj(self.up_proj(self.norm(x, cond))) + x


class TinyImageTransformerV2(nn.Module):
    """``ImageTransformerDenoiserModelV2`` in miniature: ``TokenMerge`` of 2x2 patches, the
    noise level through Fourier features, a projection and a ``MappingNetwork`` (RMSNorm, a
    GEGLU feed-forward) into each example's conditioning, one global-attention
    ``TransformerLayer``, ``TokenSplit``."""

    def __init__(self, width=16, d_head=8, d_ff=8, mapping=8):
        super().__init__()
        self.patch_in = nn.Linear(1 * 2 * 2, width, bias=False)
        self.time_emb = FourierFeatures(mapping)
        self.time_in_proj = nn.Linear(mapping, mapping, bias=False)
        self.mapping_in_norm, self.mapping_out_norm = RMSNorm(mapping), RMSNorm(mapping)
        self.mapping_norm = RMSNorm(mapping)
        self.mapping_up = LinearGEGLU(mapping, mapping, bias=False)
        self.mapping_down = nn.Linear(mapping, mapping, bias=False)
        self.self_attn = SelfAttentionBlock(width, d_head, mapping)
        self.ff = FeedForwardBlock(width, d_ff, mapping)
        self.out_norm = RMSNorm(width)
        self.patch_out = nn.Linear(width, 1 * 2 * 2, bias=False)

    def forward(self, x, sigma):
        n, c, hh, ww = x.shape
        c_noise = torch.log(sigma) / 4
        cond = self.time_in_proj(self.time_emb(c_noise[..., None]))
        cond = self.mapping_in_norm(cond)
        cond = cond + self.mapping_down(self.mapping_up(self.mapping_norm(cond)))
        cond = self.mapping_out_norm(cond)
        # "n c (h nh) (w nw) -> n h w (nh nw c)", then the patch projection
        x = (
            x.reshape(n, c, hh // 2, 2, ww // 2, 2)
            .permute(0, 2, 4, 3, 5, 1)
            .reshape(n, hh // 2, ww // 2, -1)
        )
        x = self.patch_in(x)
        h_pos = torch.linspace(-1, 1, hh // 2 + 1, dtype=x.dtype)
        h_pos = (h_pos[:-1] + h_pos[1:]) / 2
        pos = torch.stack(torch.meshgrid(h_pos, h_pos, indexing="ij"), dim=-1)  # make_axial_pos
        x = self.ff(self.self_attn(x, pos, cond), cond)
        x = self.patch_out(self.out_norm(x))
        return (
            x.reshape(n, hh // 2, ww // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(n, c, hh, ww)
        )


def bf16_loss(model, *row):
    """The ``Denoiser``'s loss of one example under bfloat16 autocast (a float32 model)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model.loss(*(t.float() for t in row))[0]


@pytest.mark.parametrize("precision", ["float64", "bf16"])
def test_k_diffusion_image_transformer_v2_rotary_in_place_geglu_subclass_and_ada_norms(precision):
    """crowsonkb/k-diffusion ``k_diffusion/models/image_transformer_v2.py`` (trained by
    ``train.py`` through the ``Denoiser``'s ``loss``): ``LinearGEGLU``, an ``nn.Linear``
    subclass whose own forward is the linear map and a GEGLU; ``RMSNorm`` and ``AdaRMSNorm``
    (each example's scale a linear map of its noise level's conditioning); cosine-similarity
    attention scaled by the block's own ``scale`` parameter; the rotary embedding applied in
    place by a custom ``autograd.Function`` (``ApplyRotaryEmbeddingInplace``) on q and k;
    SDPA. The model's zero-initialized layers are drawn at random here (a model that has
    trained: at zero every earlier layer's gradient is 0). Over 2 AdamW steps with the script's
    log-normal noise levels, ``grad1`` and the norms are the float64 loop's in float64. With
    the script's ``--mixed-precision bf16`` (a float32 model, the forward under bfloat16
    autocast) the model's own gradients move with bfloat16's rounding through its chain of
    norms (each example alone under the same autocast is 4.4% of its gradient's norm from the
    float64 loop): ``grad1`` is within 4e-2 of that bf16 loop's (measured 8e-3) and within 0.1
    of the float64 loop's, and its mean within 1e-2 of torch's ``.grad`` (measured 2.6e-3)."""
    B = 3
    torch.manual_seed(0)
    model = Denoiser(TinyImageTransformerV2())
    twin = copy.deepcopy(model).to(D)
    model.to(D if precision == "float64" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(2):
            reals = torch.randn(B, 1, 4, 4, generator=g, dtype=D)
            noise = torch.randn(reals.shape, generator=g, dtype=D)
            sigma = (torch.randn(B, generator=g, dtype=D) * 1.2 - 1.2).exp()
            opt.zero_grad()
            per = loop(twin, lambda *row: twin.loss(*row)[0], reals, noise, sigma)
            if precision == "float64":
                model.loss(reals, noise, sigma).mean().backward()
                assert_all({n: p.grad1 for n, p in trainable(model).items()}, per, f"step {step}")
                assert_close(h.norms(), flat(per).norm(dim=1), f"step {step}: norms")
            else:
                args = (t.float() for t in (reals, noise, sigma))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    losses = model.loss(*args)
                losses.mean().backward()
                own = flat(loop(model, lambda *row: bf16_loss(model, *row), reals, noise, sigma))
                rows = flat({n: p.grad1.double() for n, p in trainable(model).items()})
                for what, want, tol in (("the bf16 loop", own.double(), BF16),
                                        ("the float64 loop", flat(per), 0.1)):  # fmt: skip
                    err = float(((rows - want).norm(dim=1) / want.norm(dim=1)).max())
                    assert err < tol, f"step {step}: grad1 off {what} by {err:.3f}"
                    norms = h.norms().double()
                    err = float(((norms - want.norm(dim=1)) / want.norm(dim=1)).abs().max())
                    assert err < tol, f"step {step}: norms off {what} by {err:.3f}"
                summed = torch.cat([p.grad.flatten() for p in trainable(model).values()]).double()
                err = float((rows.mean(0) - summed).norm() / summed.norm())
                assert err < 1e-2, f"step {step}: grad1's mean off by {err:.4f}"
            opt.step()
            follow(twin, model)


# -- lxuechen/private-transformers: prefix-tuning ----------------------------------------------


class PrefixedBlock(NanoBlock):
    """A GPT-2 block whose attention reads a prefix of keys and values before the sequence's
    own (GPT-2 given ``past_key_values``): every position sees the whole prefix, and the
    sequence causally."""

    def forward(self, x, past):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        p = past[0].shape[2]
        mask = torch.ones(t, p + t, dtype=torch.bool).tril(diagonal=p)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class View(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.reshape(*self.shape)


class PrefixTuner(nn.Module):
    """private-transformers ``examples/table2text/models.py``'s ``PrefixTuner``: a frozen
    GPT-2 ("DON'T optimize it!") and ``extra_prefix_net``, an Embedding of the prefix
    positions (a buffer ``arange(prefix_len)`` expanded over the batch), an MLP and a view
    into every layer's keys and values, ``permute([2, 0, 3, 1, 4]).split(2)``, given to GPT-2
    as ``past_key_values``."""

    def __init__(self, vocab=16, d=8, heads=2, layers=2, prefix_len=3, mid_dim=6):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(PrefixedBlock(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            p.requires_grad_(False)
        self.register_buffer("extra_prefix_ids", torch.arange(prefix_len))
        self.extra_prefix_net = nn.Sequential(
            nn.Embedding(prefix_len, d), nn.Linear(d, mid_dim), nn.Tanh(),
            nn.Linear(mid_dim, layers * 2 * d), View((-1, prefix_len, layers * 2, heads, d // heads)),
            nn.Dropout(0.0),
        )  # fmt: skip

    def make_past_key_values(self, bsz):
        extra_prefix_ids = self.extra_prefix_ids[None, :].expand(bsz, -1)
        past_key_values = self.extra_prefix_net(extra_prefix_ids)
        return past_key_values.permute([2, 0, 3, 1, 4]).split(2, dim=0)

    def forward(self, input_ids, attention_mask=None):
        past_key_values = self.make_past_key_values(bsz=input_ids.size(0))
        p = past_key_values[0].shape[3]
        pos = torch.arange(p, p + input_ids.shape[1])  # (GPT-2 counts the past's positions)
        x = self.wte(input_ids) + self.wpe(pos)
        for block, past in zip(self.h, past_key_values, strict=True):
            x = block(x, past)
        return self.lm_head(self.ln_f(x))


def test_private_transformers_prefix_tuning_a_frozen_gpt2_through_an_expanded_prefix_net():
    """lxuechen/private-transformers ``examples/table2text`` with ``--tuning_mode prefix``:
    ``PrefixTuner``'s prefix net runs on ``extra_prefix_ids[None, :].expand(bsz, -1)`` (the
    same rows for every example, the batch made by an ``expand`` of a buffer, not read from
    the data), and each example's keys and values of the prefix are its own rows of that
    output, read by the frozen GPT-2's attention. Here 2 DP-SGD steps with ghost clipping (the
    engine's default) on table-to-text batches (``compute_loss``'s per-sequence mean token
    loss): only the prefix net trains, and ``.grad``, the noise taken off, is the float64
    loop's clipped sum, the norms the loop's."""
    C, SIGMA, B = 0.45, 0.7, 4
    torch.manual_seed(0)
    model = PrefixTuner().to(D)
    twin = copy.deepcopy(model)
    assert set(trainable(model)) == {n for n, _ in model.named_parameters() if "prefix" in n}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    noise, again = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    g = torch.Generator().manual_seed(5)
    seen = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(2):
            ids, mask, labels = table2text_batch(g, B)
            ids, labels = ids % 16, torch.where(labels == -100, labels, labels % 16)
            opt.zero_grad()
            logits = model(ids, mask)
            shift = labels[:, 1:]
            losses = F.cross_entropy(logits[:, :-1].permute(0, 2, 1), shift, reduction="none")
            losses = losses.sum(1) / (shift != -100).sum(1)
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=C, noise_multiplier=SIGMA, generator=noise, method="ghost"
            )

            def own(i, m, y):
                out = twin(i, m)[0, :-1]
                return F.cross_entropy(out, y[0, 1:], ignore_index=-100)

            per = loop(twin, own, ids, mask, labels)
            torch.testing.assert_close(norms, flat(per).norm(dim=1))
            seen.append(norms)
            got = denoised(model, again, SIGMA * C, B)
            assert_all(got, clipped_sum(per, C), f"step {step}", rtol=1e-9, atol=1e-11)
            opt.step()
            follow(twin, model)
    assert (torch.cat(seen) > C).any() and (torch.cat(seen) < C).any(), seen


# -- huggingface/pytorch-image-models: train.py with AugMix splits and the JSD loss ------------


class JsdCrossEntropy(nn.Module):
    """timm ``timm/loss/jsd.py``: the cross-entropy of the clean split (label smoothing) plus
    ``alpha`` times the Jensen-Shannon divergence of the splits' predictions from their
    clamped mixture, ``batchmean`` over the examples (AugMix, Hendrycks et al.)."""

    def __init__(self, num_splits=3, alpha=12.0, smoothing=0.1):
        super().__init__()
        self.num_splits, self.alpha, self.smoothing = num_splits, alpha, smoothing

    def forward(self, output, target):
        split_size = output.shape[0] // self.num_splits
        assert split_size * self.num_splits == output.shape[0]
        logits_split = torch.split(output, split_size)
        loss = F.cross_entropy(logits_split[0], target[:split_size], label_smoothing=self.smoothing)
        probs = [F.softmax(logits, dim=1) for logits in logits_split]
        logp_mixture = torch.clamp(torch.stack(probs).mean(axis=0), 1e-7, 1).log()
        kl = sum(F.kl_div(logp_mixture, p, reduction="batchmean") for p in probs)
        return loss + self.alpha * kl / len(probs)


def test_timm_augmix_jsd_loss_couples_the_splits_rows_added_per_example():
    """huggingface/pytorch-image-models ``train.py`` with ``--aug-splits 3 --jsd-loss``:
    ``AugMixDataset`` gives each image as a clean copy and two augmented ones, ``fast_collate``
    lays them out split after split (row ``i + j·B`` is copy ``j`` of example ``i``), and
    ``JsdCrossEntropy`` couples each example's three rows through the mixture of their
    predictions. grad1 has a row per copy, each copy's share of the gradient; with
    ``loss_reduction="sum"`` on ``loss · B`` (the loss is ``batchmean``), an example's own
    gradient is its three rows added up: the float64 loop's of the JSD loss of its three
    copies alone, over 2 SGD steps. ``h.check(loss_fn, x, y)``, which recomputes examples one
    row at a time, cannot run this loss (timm's assertion that the rows split in three): it is
    refused saying so, with nothing changed, where it let the loss's own error through;
    without the loss, ``h.check()`` finds no problem (grad1's rows add up to ``.grad``)."""
    from harness import assert_untouched, model_state

    B = 3
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).to(D)  # fmt: skip
    twin = copy.deepcopy(model)
    train_loss_fn = JsdCrossEntropy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(2):
            clean = torch.randn(B, 3, 6, 6, generator=g, dtype=D)
            copies = [clean, clean.flip(-1) * 0.9, clean.roll(1, -2) + 0.1]  # (AugMix's ops)
            x = torch.cat(copies)  # fast_collate: row i + j·B
            target = torch.randint(3, (B,), generator=g).repeat(3)
            opt.zero_grad()
            (train_loss_fn(model(x), target) * B).backward()
            own = {n: p.grad1.view(3, B, *p.shape).sum(0) for n, p in model.named_parameters()}
            per = loop(
                twin,
                lambda a, b, c, y: train_loss_fn(twin(torch.cat([a, b, c])), y.repeat(3)),
                *copies, target[:B],
            )  # fmt: skip
            assert_all(own, per, f"step {step}")
            if step == 0:
                before = model_state(model)
                with pytest.raises(gradhooks.ConfigurationError) as info:
                    h.check(train_loss_fn, x, target, raise_on_error=False)
                for part in ("raised AssertionError", "a batch of one example", "JsdCrossEntropy",
                             "h.check() without the loss", "Nothing was changed"):  # fmt: skip
                    assert part in str(info.value), (part, str(info.value))
                assert_untouched(model, before)
                report = h.check(raise_on_error=False)  # (grad1 against .grad: it holds)
                assert not report.problems and report.unchecked, report
            opt.step()
            follow(twin, model)


# -- mansheej/data_diet: EL2N and GraNd scores early in training ---------------------------------


def test_data_diet_el2n_is_the_heads_bias_gradient_and_grand_the_whole_norm_after_training():
    """mansheej/data_diet ``data_diet/scores.py``: ``get_lord_error_fn(..., ord=2)`` (EL2N, the
    norm of ``softmax(f(x)) - y``) and ``get_grad_norm_fn`` (GraNd, the norm of each example's
    whole gradient of its cross-entropy), both through the model in test mode (batch norm on
    its running statistics), computed a few steps into training and averaged over runs
    (``scripts/get_mean_score.py``); ``run_keep_max_scores.py`` keeps the highest-scoring
    examples. With gradhooks, one backward of the summed cross-entropy per run gives both: the
    head's bias ``grad1`` is ``softmax - onehot`` row by row, so EL2N is its norm, and GraNd is
    ``h.norms()``. Over 2 runs of 2 training steps each, EL2N is the script's formula, GraNd the
    float64 loop's, and the examples kept by either mean score are the script's."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 3, 6, 6, generator=g, dtype=D)
    y = torch.randint(4, (8,), generator=g)
    el2n, grand, want_el2n, want_grand = [], [], [], []
    for run in range(2):
        torch.manual_seed(run)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4),
        ).to(D)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):  # (training, batch statistics: no hooks)
            idx = torch.randperm(8, generator=g)[:4]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        model.eval()
        with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
            F.cross_entropy(model(x), y, reduction="sum").backward()
            el2n.append(model[5].bias.grad1.norm(dim=1))
            grand.append(h.norms())
        with torch.no_grad():
            errors = F.softmax(model(x), -1) - F.one_hot(y, 4).to(D)
        want_el2n.append(torch.linalg.norm(errors, ord=2, dim=-1))
        per = loop(model, lambda a, b, m=model: F.cross_entropy(m(a), b), x, y)
        want_grand.append(flat(per).norm(dim=1))
        assert_close(el2n[-1], want_el2n[-1], f"run {run}: EL2N")
        assert_close(grand[-1], want_grand[-1], f"run {run}: GraNd")
    for name, got, want in (("EL2N", el2n, want_el2n), ("GraNd", grand, want_grand)):
        mean, want_mean = torch.stack(got).mean(0), torch.stack(want).mean(0)
        assert_close(mean, want_mean, f"mean {name}")
        assert (
            mean.argsort(descending=True)[:5].tolist()
            == want_mean.argsort(descending=True)[:5].tolist()
        )


def test_kfac_pytorch_engine_fp16_grad_scaler_skips_an_overflowed_step():
    """gpauloski/kfac-pytorch ``examples/vision/engine.py`` with ``--fp16``: the forward under
    float16 autocast, ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``,
    ``preconditioner.step()``, ``scaler.step(optimizer)``, ``scaler.update()``. With
    ``gradhooks.KFAC`` the same lines run as ``scaler.unscale_(kfac)`` and ``scaler.step(kfac,
    data, target)`` (``KFAC.param_groups`` is its base optimizer's): where the scaled gradients
    overflowed (the first step, at a large initial scale) the step is skipped as the
    script's, the weights, factors and step count as they were, and the scale lowered
    (``kfac.step`` itself refused such gradients, saying the model diverged, and
    ``scaler.step(kfac, ...)`` failed on the missing ``param_groups``); the steps taken are
    those of a float64 twin preconditioned by hand with the unscaled gradients and the float64
    loop's factors (within float32's rounding: the factors' forward runs in float32)."""
    DAMPING, DECAY = 1e-2, 0.95
    torch.manual_seed(0)
    model = KfacNet()
    twin = copy.deepcopy(model).to(D)
    kfac = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.1), damping=DAMPING, decay=DECAY,
        fisher="empirical",
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, backoff_factor=2.0**-20)
    g = torch.Generator().manual_seed(3)
    running, skipped, taken = None, 0, 0
    for _ in range(3):
        data = torch.randn(6, 1, 6, 6, generator=g)
        target = torch.randint(4, (6,), generator=g)
        kfac.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = model(data)
            loss = F.cross_entropy(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(kfac)
        grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps, scale = kfac.steps, scaler.get_scale()
        overflowed = not all(torch.isfinite(t).all() for t in grads.values())
        if overflowed:  # (the step itself refuses it, pointing to the scaler)
            with pytest.raises(gradhooks.NumericalError, match=r"scaler\.step\(kfac, inputs"):
                kfac.step(data, target)
        scaler.step(kfac, data, target)
        scaler.update()
        if overflowed:  # skipped
            skipped += 1
            assert kfac.steps == steps and scaler.get_scale() < scale
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n]), n
            continue
        taken += 1
        new = own_factors(twin, data.double(), target)
        running = new if running is None else {
            k: [DECAY * r + (1 - DECAY) * f for r, f in zip(running[k], new[k], strict=True)]
            for k in new
        }  # fmt: skip
        for k, layer in (("conv.weight", twin.conv), ("fc.weight", twin.fc)):
            A, G = running[k]
            prefix = k.rpartition(".")[0]
            grad = torch.cat([grads[k].flatten(1), grads[f"{prefix}.bias"][:, None]], 1)
            eye = torch.eye(grad.numel(), dtype=D)
            natural = torch.linalg.solve(torch.kron(G, A) + DAMPING * eye, grad.flatten())
            natural = natural.view(grad.shape)
            with torch.no_grad():
                layer.weight -= 0.1 * natural[:, :-1].reshape(layer.weight.shape)
                layer.bias -= 0.1 * natural[:, -1]
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.double(), q, rtol=1e-4, atol=1e-6, msg=n)
        follow(twin, model)
    assert skipped == 1 and taken == 2 and kfac.steps == 2

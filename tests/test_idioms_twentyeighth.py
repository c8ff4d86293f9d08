"""Training-loop idioms, a twenty-eighth set: what a loop changes on a hooked model after
``add_hooks``, between its steps or between a forward and its backward.

Each test runs several steps of an ordinary loop (``zero_grad``, a forward, a backward, an
optimizer's step) with one change the earlier sets do not make: a forward hook or pre-hook of
the user's registered after ``add_hooks`` with ``with_kwargs=True``, ``always_call=True`` or
``prepend=True``, returning a new output or input, under float16 autocast and a ``GradScaler``
too; global forward hooks and pre-hooks (``register_module_forward_hook``) registered and
removed in the middle of training; a max-norm constraint written by a forward pre-hook into
the weight, in place without grad (registered before ``add_hooks`` or after, from a given step,
under bfloat16 autocast too; found and fixed: registered before, the write was taken for a use
of the weight outside its layer's call, and ``grad1`` held each example's gradient twice, in
silence where the backward was not one the check compares), or by reassigning ``.data`` in the
layer's own forward (braindecode's ``Conv2dWithConstraint``); a layer unfrozen by
``requires_grad_`` in its own forward pre-hook (found and fixed likewise: ``grad1`` doubled, or
refused at a checked backward); a model pre-hook that freezes the body on some steps;
``nn.utils.prune`` applied after ``add_hooks`` and made permanent; ``spectral_norm`` (the
hook-based one and the parametrization) on a layer put in ``eval()`` alone; ``weight_norm``
registered after ``add_hooks`` and removed; a weight replaced by a new ``nn.Parameter`` and a
bias set to ``None`` and back; ``model.apply`` re-initializing the head; an embedding grown by
setting its ``.data`` to a larger tensor (found and fixed: the ``AccumulateGrad`` node gradhooks
held kept the old shape, and the next backward stopped with torch's "invalid gradient"), and
Hugging Face's ``resize_token_embeddings`` (which does that), ``gradient_checkpointing_enable``
and ``_disable`` after ``add_hooks``; dropout's ``p`` changed and a dropout put in ``eval()``
alone; weights decayed in place, or their ``.data`` replaced, between a forward and its
backward; an optimizer's step between two backwards of one forward; a model compiled after
``add_hooks`` whose hooks are then removed.

Every ``grad1`` is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`) of the weights the forward used, exactly in
float64, or within the rounding of the precision the step ran in (``5e-2`` of the largest entry
for bfloat16, ``1e-2`` for float16, as ``docs/mixed-precision.md`` states), divided by the scale
where the loss was scaled; and its mean with ``.grad``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, one_thread

D = torch.float64
BF16, FP16 = 5e-2, 1e-2  # the rounding allowed: of the largest entry, per parameter
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def batch(step: int, n: int = 4, dtype=D):
    """``n`` examples of 4 features and their labels of 3 classes, seeded with ``step``."""
    g = torch.Generator().manual_seed(400 + step)
    x = torch.randn(n, 4, generator=g, dtype=D).to(dtype)
    return x, torch.randint(3, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out.float() if out.dtype not in (D, torch.float32) else out, y)


def near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """``got`` within ``rel`` of ``want``'s largest entry (and of the same shape)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: {err:.3e} off, largest {scale:.3e}"


def loop(model: nn.Module, x, y, live: bool = False) -> dict:
    """Each example's own gradient at ``model``'s weights now, by the float64 loop: of a
    float64 copy, or of ``model`` itself where its hooks write its weights (``live``)."""
    if live:
        return loop_grad(model, ce, x, y)
    return loop_grad(copy.deepcopy(model).to(D), ce, x.double(), y)


def assert_step(model, want: dict, what: str, rel: float = 0.0, scale: float = 1.0) -> int:
    """Every trainable parameter the step reached: ``grad1 / scale`` against ``want`` (exactly
    in float64 where ``rel`` is 0) and ``grad1``'s mean against ``.grad``. Returns how many
    were checked."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        if rel:
            near(p.grad1 / scale, want[n], rel, f"{what}: {n}")
            near(p.grad1.mean(0), p.grad, rel, f"{what}: {n} reduced vs .grad")
        else:
            assert_close(p.grad1, want[n], f"{what}: {n}")
            assert_close(p.grad1.mean(0), p.grad, f"{what}: {n} reduced vs .grad")
        checked += 1
    assert checked, what
    return checked


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh-Linear (4 -> 6 -> 6 -> 3), seeded, float64 by default."""

    def __init__(self, dtype=D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.to(dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def train(model, steps: int, change=None, live: bool = False, lr: float = 0.1) -> None:
    """``steps`` steps of SGD over every parameter the model has at each step (an optimizer
    made again where ``change(model, step)`` changed them), each step's ``grad1`` checked."""
    with gradhooks.add_hooks(model):
        for step in range(steps):
            if change is not None:
                change(model, step)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            x, y = batch(step)
            want = loop(model, x, y, live)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()


# -- the user's forward hooks, registered after add_hooks -------------------------------------


def test_a_forward_hook_with_kwargs_and_always_call_registered_after_add_hooks():
    """From step 1 a forward hook (``with_kwargs=True, always_call=True``) scales and shifts
    the middle layer's output; from step 2 another, ``prepend=True``, clamps it: each step's
    ``grad1`` is each example's own gradient through the hooked outputs, as the loop of the
    model with the same hooks gives it."""

    def change(model, step):
        if step == 1:
            model.l2.register_forward_hook(
                lambda m, args, kwargs, out: 1.5 * out + 0.1, with_kwargs=True, always_call=True
            )
        if step == 2:
            model.l2.register_forward_hook(lambda m, a, out: out.clamp(-0.5, 0.5), prepend=True)

    train(Net(), 4, change)


def test_a_forward_pre_hook_with_kwargs_and_prepend_registered_after_add_hooks():
    """A pre-hook with ``with_kwargs=True`` that rescales the middle layer's input from step 1,
    and one with ``prepend=True`` that reverses its features from step 2: ``grad1`` is the
    gradient at the input the layer computed with."""

    def change(model, step):
        if step == 1:
            model.l2.register_forward_pre_hook(
                lambda m, args, kwargs: ((3.0 * args[0] - 0.2,), kwargs), with_kwargs=True
            )
        if step == 2:
            model.l2.register_forward_pre_hook(lambda m, a: (a[0].flip(-1),), prepend=True)

    train(Net(), 4, change)


def test_global_forward_hooks_registered_and_removed_in_the_middle_of_training():
    """``register_module_forward_pre_hook`` halving the input of the layers marked ``halve``
    and ``register_module_forward_hook(..., always_call=True)`` boosting the output of those
    marked ``boost``, registered at step 1 and removed at step 3: every step's ``grad1`` is the
    loop's of the model as it then runs."""
    handles = []

    def change(model, step):
        if step == 1:
            model.l2.halve = model.l1.boost = True
            handles.append(
                torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda m, a: (0.5 * a[0],) if getattr(m, "halve", False) else None
                )
            )
            handles.append(
                torch.nn.modules.module.register_module_forward_hook(
                    lambda m, a, out: 1.5 * out + 0.1 if getattr(m, "boost", False) else None,
                    always_call=True,
                )
            )
        if step == 3:
            while handles:
                handles.pop().remove()

    try:
        train(Net(), 4, change)
    finally:
        for h in handles:
            h.remove()


def test_a_forward_hook_registered_after_add_hooks_under_float16_and_a_grad_scaler():
    """A forward hook with ``with_kwargs=True`` registered after ``add_hooks`` on the middle
    layer, float16 autocast and a ``GradScaler``: ``grad1`` divided by the scale is each
    example's own gradient (within float16's rounding), its mean ``.grad`` before
    ``unscale_``."""
    model = Net(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model):
        model.l2.register_forward_hook(
            lambda m, args, kwargs, out: 2.0 * out, with_kwargs=True, always_call=True
        )
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(ce(out, y)).backward()
            for n, p in model.named_parameters():
                near(p.grad1 / scale, want[n], FP16, f"step {step}: {n}")
                near(p.grad1.mean(0), p.grad, FP16, f"step {step}: {n} vs .grad")
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()


# -- weights written by the user's hooks ------------------------------------------------------


def max_norm(module, args):
    """A max-norm constraint on each output unit's weights (0.5), written into the weight in
    place without grad before the call."""
    with torch.no_grad():
        module.weight.copy_(torch.renorm(module.weight, 2, 0, 0.5))


@pytest.mark.parametrize("when", ["before add_hooks", "after add_hooks"])
def test_a_max_norm_constraint_written_by_a_forward_pre_hook_from_a_given_step(when):
    """The constraint on the first and the last layer, switched on at step 2 (after a
    warm-up). Registered before ``add_hooks`` the hook runs before gradhooks' pre-hook, where
    the in-place write was taken for a use of the weight outside its layer's call: ``grad1`` of
    those weights held each example's gradient twice, in silence at the third backward (which
    the check does not compare), and refused at a checked one. Each step's ``grad1`` is now the
    loop's at the constrained weights."""
    on = {"now": False}

    def constraint(module, args):
        if on["now"]:
            max_norm(module, args)

    model = Net()
    if when == "before add_hooks":
        for layer in (model.l1, model.head):
            layer.register_forward_pre_hook(constraint)

    def change(model, step):
        on["now"] = step >= 2
        if step == 0 and when == "after add_hooks":
            for layer in (model.l1, model.head):
                layer.register_forward_pre_hook(constraint)

    train(model, 5, change, live=True)
    assert torch.renorm(model.l1.weight, 2, 0, 0.5).sub(model.l1.weight).abs().max() < 0.2


def test_a_max_norm_constraint_in_a_pre_hook_under_bfloat16_autocast():
    """The max-norm pre-hook registered before ``add_hooks``, on from the second step, a
    float32 model under bfloat16 autocast: ``grad1`` is each example's own gradient at the
    constrained weights, within bfloat16's rounding, at every step."""
    model = Net(dtype=torch.float32)
    on = {"now": False}
    model.l1.register_forward_pre_hook(lambda m, a: max_norm(m, a) if on["now"] else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            on["now"] = step >= 1
            x, y = batch(step, dtype=torch.float32)
            if on["now"]:
                max_norm(model.l1, ())  # (the weights the forward will use)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            ce(out, y).backward()
            assert_step(model, want, f"step {step}", rel=BF16)
            optimizer.step()


class Conv2dWithConstraint(nn.Conv2d):
    """braindecode's ``Conv2dWithConstraint`` (``braindecode/models/eegnet.py``): the weight's
    ``.data`` renormalized to ``max_norm`` in the layer's own forward, then the convolution."""

    def __init__(self, *args, max_norm: float = 1.0, **kwargs):
        self.max_norm = max_norm
        super().__init__(*args, **kwargs)

    def forward(self, x):
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=self.max_norm)
        return super().forward(x)


def test_braindecodes_conv_with_constraint_renormalizing_its_data_in_its_forward():
    """An EEGNet-like depthwise spatial filter (``Conv2dWithConstraint``, groups) after a
    temporal convolution, trained by Adam: ``grad1`` is each example's own gradient at the
    renormalized weights, every step."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, (1, 3), bias=False),
        Conv2dWithConstraint(2, 4, (3, 1), groups=2, bias=False, max_norm=0.3),
        nn.ELU(),
        nn.Flatten(),
        nn.Linear(4 * 1 * 4, 3),
    ).to(D)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(3, 1, 3, 6, generator=g, dtype=D), torch.randint(3, (3,))
            want = loop_grad(model, ce, x, y)  # (renormalizes the live weight, as the step will)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert model[1].weight.flatten(1).norm(dim=1).max() <= 0.3 + 1e-9
            assert_step(model, want, f"step {step}")
            optimizer.step()


@pytest.mark.parametrize("when", ["before add_hooks", "after add_hooks"])
def test_a_layer_unfrozen_by_requires_grad_in_its_own_forward_pre_hook(when):
    """Gradual unfreezing written as a pre-hook on the first layer: ``requires_grad_(step >=
    2)`` on its weight before each call. Registered before ``add_hooks``, the call of
    ``requires_grad_`` (which returns the weight) was taken for a use of it outside its call:
    ``grad1`` doubled, or refused at a checked backward (even while the weight was trainable
    already). Frozen steps give the weight no ``.grad`` and no ``grad1``; unfrozen ones the
    loop's."""
    state = {"step": 0}

    def unfreeze(module, args):
        module.weight.requires_grad_(state["step"] >= 2)

    model = Net()
    model.l1.weight.requires_grad_(False)
    if when == "before add_hooks":
        model.l1.register_forward_pre_hook(unfreeze)

    def change(model, step):
        state["step"] = step
        if step == 0 and when == "after add_hooks":
            model.l1.register_forward_pre_hook(unfreeze)
        model.l1.weight.requires_grad_(step >= 2)  # (what the hook will set: for the loop)

    with gradhooks.add_hooks(model):
        for step in range(4):
            change(model, step)
            x, y = batch(step)
            want = loop(model, x, y)
            model.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == (5 if step < 2 else 6)
            assert (model.l1.weight.grad is None) == (step < 2)
            assert ("grad1" in model.l1.weight.__dict__) == (step >= 2)


def test_the_body_frozen_on_some_steps_by_a_model_pre_hook():
    """A pre-hook on the model that sets ``requires_grad`` on the body's parameters (frozen at
    steps 1 and 2, trained at 0 and 3), an optimizer over every parameter: the frozen steps give
    the body no ``grad1`` (the last one's deleted, not left to be read as this one's); the
    others give the loop's."""
    state = {"train_body": True}

    def toggle(model, args):
        for layer in (model.l1, model.l2):
            layer.requires_grad_(state["train_body"])

    model = Net()
    model.register_forward_pre_hook(toggle)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            state["train_body"] = step in (0, 3)
            toggle(model, ())
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == (6 if step in (0, 3) else 2)
            for p in model.l1.parameters():
                assert ("grad1" in p.__dict__) == (step in (0, 3))
            optimizer.step()


# -- layers re-parametrized, replaced or re-initialized after add_hooks --------------------------


def test_pruning_applied_after_add_hooks_then_made_permanent():
    """``prune.l1_unstructured`` on the middle layer at step 1 (its forward pre-hook makes
    ``weight`` from ``weight_orig`` and the mask), ``prune.remove`` at step 3: ``grad1`` of
    ``weight_orig`` is the masked gradient of each example, then that of the pruned weight,
    as the loop gives them."""

    def change(model, step):
        if step == 1:
            prune.l1_unstructured(model.l2, "weight", amount=0.5)
        if step == 3:
            prune.remove(model.l2, "weight")

    train(Net(), 5, change, live=True)


@pytest.mark.parametrize("kind", ["hook", "parametrization"])
def test_spectral_norm_registered_after_add_hooks_on_a_layer_put_in_eval_alone(kind):
    """``spectral_norm`` (torch's hook-based one, or the parametrization) on the middle layer
    at step 1, that layer alone put in ``eval()`` (its power iteration stopped) while the rest
    trains: ``grad1`` is each example's own gradient through the normalized weight."""

    def change(model, step):
        if step == 1:
            if kind == "hook":
                torch.nn.utils.spectral_norm(model.l2)
            else:
                torch.nn.utils.parametrizations.spectral_norm(model.l2)
            model.l2.eval()
        assert model.training and model.l2.training == (step == 0)

    train(Net(), 4, change, live=True)


def test_weight_norm_registered_after_add_hooks_and_removed():
    """``parametrizations.weight_norm`` on the middle layer at step 1 (``original0`` and
    ``original1`` trained), removed with ``remove_parametrizations`` at step 3 (a plain
    ``weight`` again): each step's ``grad1`` is the loop's."""

    def change(model, step):
        if step == 1:
            torch.nn.utils.parametrizations.weight_norm(model.l2)
        if step == 3:
            parametrize.remove_parametrizations(model.l2, "weight")

    train(Net(), 4, change)


def test_a_weight_replaced_by_a_new_parameter_and_a_bias_removed_and_put_back():
    """``model.l2.weight = nn.Parameter(...)`` at step 1, ``model.l2.bias = None`` at step 2,
    a new zero bias registered at step 3, the optimizer made again over ``parameters()``: the
    new tensors get ``grad1``, the loop's, and the model trains without the bias between."""

    def change(model, step):
        if step == 1:
            model.l2.weight = nn.Parameter(0.5 * model.l2.weight.detach())
        if step == 2:
            model.l2.bias = None
        if step == 3:
            model.l2.bias = nn.Parameter(torch.zeros(6, dtype=D))

    train(Net(), 4, change)


def test_the_head_reinitialized_by_model_apply_between_steps():
    """The head re-initialized by ``model.apply`` at step 2 (orthogonal weight, zero bias, in
    place, as periodic resets do), the optimizer's momentum kept: ``grad1`` is the loop's at
    the new weights."""

    def reset(m):
        if m is model.head:
            nn.init.orthogonal_(m.weight)
            nn.init.zeros_(m.bias)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                model.apply(reset)
                assert model.head.bias.abs().max() == 0
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()


class TiedLM(nn.Module):
    """An embedding of 6 tokens tied to the output projection, float64, seeded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight
        self.to(D)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def token_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def test_an_embedding_grown_by_setting_its_data_after_add_hooks():
    """New tokens added at step 1 the way Hugging Face's ``resize_token_embeddings`` adds
    them: the same parameter, its ``.data`` set to a larger tensor (the old rows and two new
    ones). The ``AccumulateGrad`` node gradhooks held kept the old shape, and the next backward
    stopped with torch's "returned an invalid gradient" (without gradhooks it trains); now each
    step's ``grad1`` is the loop's, of the new shape, the new tokens' rows included."""
    model = TiedLM()
    with gradhooks.add_hooks(model):
        for step in range(3):
            if step == 1:
                old = model.emb.weight.data
                model.emb.weight.data = torch.cat([old, old.mean(0).expand(2, -1)])
                model.emb.num_embeddings = model.out.out_features = 8
            vocab = model.emb.weight.shape[0]
            g = torch.Generator().manual_seed(step)
            ids, y = torch.randint(vocab, (3, 4), generator=g), torch.randint(vocab, (3, 4))
            want = loop_grad(copy.deepcopy(model), token_loss, ids, y)
            model.zero_grad()
            token_loss(model(ids), y).backward()
            assert model.emb.weight.grad1.shape == (3, vocab, 4)
            assert_step(model, want, f"step {step}")
            with torch.no_grad():
                model.emb.weight -= 0.1 * model.emb.weight.grad


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
def test_hugging_face_resize_token_embeddings_and_gradient_checkpointing_after_add_hooks():
    """A tiny GPT-2 (tied head) hooked, then ``resize_token_embeddings(24)`` at step 1,
    ``gradient_checkpointing_enable`` (non-reentrant) at step 2, ``_disable`` at step 3: the
    head stays tied, and every step's ``grad1`` is the loop's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config).to(D)
    lm.config.use_cache = False

    class Logits(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    model = Logits(lm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 1:
                lm.resize_token_embeddings(24, mean_resizing=False)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if step == 2:
                lm.gradient_checkpointing_enable({"use_reentrant": False})
            if step == 3:
                lm.gradient_checkpointing_disable()
            vocab = lm.get_input_embeddings().weight.shape[0]
            assert lm.lm_head.weight is lm.transformer.wte.weight
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(vocab, (3, 5), generator=g)
            y = torch.randint(vocab, (3, 5), generator=g)
            want = loop_grad(copy.deepcopy(model), token_loss, ids, y)
            optimizer.zero_grad()
            token_loss(model(ids), y).backward()
            assert lm.transformer.wte.weight.grad1.shape == (3, vocab, 8)
            assert_step(model, want, f"step {step}")
            optimizer.step()


def test_dropouts_p_changed_and_a_dropout_put_in_eval_alone():
    """A dropout before the head: off (``p = 0``) at step 0, on (``p = 0.3``) at step 1,
    where ``grad1``'s mean is ``.grad`` (the loop cannot draw the batch's mask), and put in
    ``eval()`` alone from step 2 while the model trains: ``grad1`` the loop's where no mask is
    drawn."""

    class Dropped(Net):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.0)

        def forward(self, x):
            return self.head(self.drop(torch.tanh(self.l2(torch.tanh(self.l1(x))))))

    model = Dropped()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.drop.p = 0.0 if step == 0 else 0.3
            if step >= 2:
                model.drop.eval()
            assert model.training
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            if step == 1:
                for n, p in model.named_parameters():
                    assert_close(p.grad1.mean(0), p.grad, f"step 1: {n}")
            else:
                assert_step(model, want, f"step {step}")
            optimizer.step()


# -- between a forward and its backward --------------------------------------------------------


@pytest.mark.parametrize("how", ["decayed in place", "data replaced", "data cloned"])
def test_the_first_layers_weights_changed_between_the_forward_and_its_backward(how):
    """An EMA-style decay written into the live first layer under ``no_grad`` after the
    forward, its ``.data`` replaced by a halved tensor, or by a clone: autograd, which kept no
    copy of them (the input needs no gradient), gives the gradient of the forward's weights,
    and so does ``grad1``."""
    model = Net()
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop(model, x, y)
            model.zero_grad()
            loss = ce(model(x), y)
            if how == "decayed in place":
                with torch.no_grad():
                    for p in model.l1.parameters():
                        p.mul_(0.9)
            else:
                for p in model.l1.parameters():
                    p.data = p.data * (0.5 if how == "data replaced" else 1.0)
            loss.backward()
            assert_step(model, want, f"step {step}")


def test_an_optimizer_step_between_two_backwards_of_one_forward():
    """A linear probe (a single Linear on inputs that need no gradient): two losses of one
    forward through a retained graph, the optimizer stepping after the first backward: the
    second backward's ``grad1`` is that of the forward's weights, as its ``.grad`` is."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(D)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            want = loop(model, x, y)
            out = model(x)
            optimizer.zero_grad()
            ce(out, y).backward(retain_graph=True)
            assert_step(model, want, f"step {step}, first")
            optimizer.step()
            optimizer.zero_grad()
            ce(out, y).backward()
            assert_step(model, want, f"step {step}, second")
            optimizer.step()


def test_a_model_compiled_after_add_hooks_then_its_hooks_removed():
    """``torch.compile`` (the eager backend) applied after ``add_hooks``: its steps' ``grad1``
    is the loop's; after ``remove()`` the compiled model trains on, its ``.grad`` the loop's
    mean, and the last ``grad1`` is left as it was, not written by the backwards after."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    h = gradhooks.add_hooks(model)
    compiled = torch.compile(model, backend="eager")
    for step in range(2):
        x, y = batch(step)
        want = loop(model, x, y)
        optimizer.zero_grad()
        ce(compiled(x), y).backward()
        assert_step(model, want, f"step {step}")
        optimizer.step()
    h.remove()
    kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
    x, y = batch(5, n=3)
    want = loop(model, x, y)
    optimizer.zero_grad()
    ce(compiled(x), y).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad1, kept[n]), n
        assert_close(p.grad, want[n].mean(0), n)

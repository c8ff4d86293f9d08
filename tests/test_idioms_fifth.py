"""Training-loop idioms and misuse, a fifth set, each step checked against the float64 oracle.

Each test runs an idiom as training code writes it (accelerate's ``prepare``, ``backward``,
``accumulate`` and ``clip_grad_norm_``; ``AveragedModel``; siamese pairs; a recurrence
unrolled to the input's length; reentrant checkpointing; packed sequences; a ``BatchEncoding``
batch; forward hooks of the user's registered after ``add_hooks``) on a small model, and at
every step compares ``grad1`` (or the DP step) with each example's own gradient by a
per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out where
an example is not one row of one input), within a stated tolerance under mixed precision; or
checks that a misuse stops with an error that says what went wrong and leaves the model as it
was, or has the documented meaning.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1, mlp

D = torch.float64


def batch(seed: int = 0, n: int = 4, dtype: torch.dtype = D):
    """``n`` examples of 3 features and their labels (2 classes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randint(2, (n,), generator=g)


def added(a: dict, b: dict, c: float = 1.0) -> dict:
    return {n: a[n] + c * b[n] for n in b}


# -- forward hooks of the user's ---------------------------------------------------------------


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_forward_hook_put_first_after_add_hooks_does_not_hide_the_layers_output(verify):
    """A forward hook registered after ``add_hooks`` with ``prepend=True`` that returns a new
    output (``out * 3``) would run before gradhooks' own, which would then take the
    output-gradient at the new output (a third of the layer's own: a wrong ``grad1``, silent
    without the run-time check). Each forward puts gradhooks' hook first again."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, verify=verify):
        handle = model[0].register_forward_hook(lambda m, a, out: out * 3.0, prepend=True)
        with gradhooks.paused():
            want = loop_grad(model, F.cross_entropy, x, y)
        for step in range(3):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
        handle.remove()


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_hooks_added_from_a_forward_hook_while_the_forward_runs(verify):
    """``add_hooks`` called from a forward hook of the first layer (lazily, on the first
    forward): that layer's call ran before the hooks, the next one's after. The backward warns
    that the first layer's call was not captured, as for hooks added after the whole forward,
    and gives it no ``grad1``; the layer after it has its own (with the run-time check too,
    which has no ``grad1`` of the first layer to compare). The next step captures both."""
    model = mlp()
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    made = []

    def hook_lazily(module, args, output):
        if not made:
            made.append(gradhooks.add_hooks(model, verify=verify))

    handle = model[0].register_forward_hook(hook_lazily)
    out = model(x)
    with pytest.warns(gradhooks.GradhooksWarning, match="'0.bias', '0.weight' but no forward"):
        F.cross_entropy(out, y).backward()
    assert not hasattr(model[0].weight, "grad1") and not hasattr(model[0].bias, "grad1")
    torch.testing.assert_close(model[2].weight.grad1, want["2.weight"], rtol=1e-7, atol=1e-9)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "the next step")
    handle.remove()
    made[0].remove()


# -- freezing and unfreezing ---------------------------------------------------------------------


def test_a_layer_frozen_between_the_forward_and_the_backward_gets_no_grad1_as_no_grad():
    """``requires_grad_(False)`` after the forward: autograd still computes the layer's
    gradient but leaves ``.grad`` as it was, so ``grad1`` is left as it was too (none after a
    reset, the earlier micro-batch's in an accumulation); the norms cover the parameters that
    get a gradient. Unfrozen again, the layer's next step has its ``grad1``."""
    model = mlp()
    (x, y), (x2, y2) = batch(0), batch(1)
    first, second = (
        loop_grad(model, F.cross_entropy, x, y),
        loop_grad(model, F.cross_entropy, x2, y2),
    )
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        out = model(x)
        model[0].requires_grad_(False)
        F.cross_entropy(out, y).backward()
        assert model[0].weight.grad is None and not hasattr(model[0].weight, "grad1")
        assert_grad1(model, first, "frozen after the forward")
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        want = sum(first[n].flatten(1).square().sum(1) for n in trainable).sqrt()
        torch.testing.assert_close(h.norms(), want)

        model.zero_grad()
        model[0].requires_grad_(True)
        F.cross_entropy(model(x), y).backward()  # a micro-batch, all trainable
        out = model(x2)
        model[0].requires_grad_(False)
        F.cross_entropy(out, y2).backward()  # the next, frozen after its forward
        model[0].requires_grad_(True)
        want = {n: first[n] if n.startswith("0.") else first[n] + second[n] for n in first}
        assert_grad1(model, want, "accumulated, the layer frozen for the second")
        torch.testing.assert_close(model[0].weight.grad1.mean(0), model[0].weight.grad)


# -- Hugging Face accelerate ---------------------------------------------------------------------


@pytest.fixture
def accelerate():
    """The accelerate module, its process-wide state reset before and after the test (an
    ``Accelerator`` of another mixed precision is refused while one exists)."""
    module = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield module
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("hooked", ["before", "after"], ids=["hooks-before-prepare", "after"])
def test_accelerate_accumulate_backward_and_clip_grad_norm(accelerate, hooked):
    """``Accelerator(gradient_accumulation_steps=2).prepare(model, opt, loader)``, then per
    batch ``with accelerator.accumulate(model)``: ``accelerator.backward`` (which divides the
    loss by 2), ``accelerator.clip_grad_norm_`` where it syncs, ``opt.step()`` and
    ``opt.zero_grad()`` (which act only where it syncs): 10 examples in batches of 4, 4 and 2.
    ``grad1`` holds each example's gradient over 2 through the accumulation, afresh after each
    real step, and the weights follow a twin trained without hooks, with ``add_hooks`` before
    or after ``prepare``."""
    from torch.utils.data import DataLoader, TensorDataset

    model = mlp()
    twin, (x, y) = copy.deepcopy(model), batch(0, n=10)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    h = gradhooks.add_hooks(model) if hooked == "before" else None
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    prepared, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    h = h or gradhooks.add_hooks(prepared)
    held, syncs = None, 0
    for i, (xb, yb) in enumerate(loader):
        with acc.accumulate(prepared):
            own = {n: g / 2 for n, g in loop_grad(twin, F.cross_entropy, xb, yb).items()}
            held = own if held is None else added(held, own)
            acc.backward(F.cross_entropy(prepared(xb), yb))
            (F.cross_entropy(twin(xb), yb) / 2).backward()
            assert_grad1(prepared, held, f"batch {i}")
            if acc.sync_gradients:
                acc.clip_grad_norm_(prepared.parameters(), 0.1)
                torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
                twin_opt.step()
                twin_opt.zero_grad()
                held, syncs = None, syncs + 1
            opt.step()
            opt.zero_grad()
    assert syncs == 2  # (after 2 batches, and at the loader's end)
    for (n, p), q in zip(prepared.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=n)
    h.remove()


def test_accelerate_bf16_mixed_precision_against_the_float64_loop(accelerate):
    """``Accelerator(mixed_precision="bf16")`` wraps the prepared model's forward in bfloat16
    autocast (replacing ``forward`` on the instance). ``grad1`` of the float32 model, over
    steps, against the float64 loop: within 3e-2 of the largest entry (bfloat16 keeps 8
    significant bits, a relative rounding of 2^-8 = 3.9e-3 per product, over a 3-5-2 MLP with
    its inputs, weights and output-gradients each rounded)."""
    model = mlp(torch.float32)
    twin = copy.deepcopy(model).double()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with gradhooks.add_hooks(model):
        prepared, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):
            x, y = batch(step, dtype=torch.float32)
            opt.zero_grad()
            acc.backward(F.cross_entropy(prepared(x), y))
            want = loop_grad(twin, F.cross_entropy, x.double(), y)
            for n, p in prepared.named_parameters():
                scale = want[n].abs().max().item()
                torch.testing.assert_close(p.grad1.double(), want[n], rtol=0, atol=3e-2 * scale)
            opt.step()
            twin.load_state_dict({k: v.double() for k, v in prepared.state_dict().items()})


def test_make_private_on_a_model_and_optimizer_prepared_by_accelerate(accelerate):
    """``make_private`` given what ``accelerator.prepare`` returned (the model, an
    ``AcceleratedOptimizer``) takes the same DP-SGD steps, bit for bit, as on the plain
    model and optimizer, and records the same ε."""
    from torch.utils.data import TensorDataset

    x, y = batch(0, n=40, dtype=torch.float32)
    runs = []
    for prepare in (False, True):
        model = mlp(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if prepare:
            model, opt = accelerate.Accelerator(cpu=True).prepare(model, opt)
        private = gradhooks.make_private(
            model, opt, TensorDataset(x, y), noise_multiplier=1.0, delta=1e-5, steps=3,
            expected_batch_size=8, max_grad_norm=1.0, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        for xb, yb in private.batches():
            private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
            private.step()
        private.close()
        runs.append(([p.detach().clone() for p in model.parameters()], private.epsilon))
    (plain, eps), (prepared, eps_prepared) = runs
    assert eps_prepared == eps and private.steps_taken == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, prepared))


# -- copies, clipping, pairs, unrolled recurrences -----------------------------------------------


def test_swa_averaged_model_of_a_hooked_model():
    """``torch.optim.swa_utils.AveragedModel`` (an EMA) of a hooked model: a deep copy, not
    hooked, with no ``grad1`` even after a backward through it; the hooked model's ``grad1`` is
    each step's own, and the average is the EMA of the weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        want_ema = [p.detach().clone() for p in model.parameters()]
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"step {step}")
            opt.step()
            ema.update_parameters(model)
            if step:  # (the first update copies the weights)
                for w, p in zip(want_ema, model.parameters()):
                    w.lerp_(p.detach(), 0.1)
            else:
                want_ema = [p.detach().clone() for p in model.parameters()]
            F.cross_entropy(ema(x), y).backward()  # through the average: no grad1 there
            assert not any(hasattr(p, "grad1") for p in ema.parameters())
    for w, p in zip(want_ema, ema.module.parameters()):
        torch.testing.assert_close(p.detach(), w)


def test_clip_grad_value_between_micro_batches_leaves_grad1_unclipped():
    """``clip_grad_value_`` after the first micro-batch's backward changes ``.grad`` in place
    (post-processing, not a reset): the second micro-batch adds to ``grad1``, which holds the
    examples' gradients never clipped (docs/training.md)."""
    model = mlp()
    (x, y), (x2, y2) = batch(0), batch(1)
    want = added(loop_grad(model, F.cross_entropy, x, y), loop_grad(model, F.cross_entropy, x2, y2))
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        F.cross_entropy(model(x2), y2).backward()
        assert h.accumulated == 2
        assert_grad1(model, want, "two micro-batches, clipped between")
    assert model[0].weight.grad.abs().max() <= 0.01 + want["0.weight"].abs().max()


class Pair(nn.Module):
    """One example of a siamese loss: the model on both sides of the pair."""

    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, a, b):
        return self.loss(self.model(a), self.model(b))


def cosine(za, zb):
    return F.cosine_similarity(za, zb)


def test_siamese_model_called_twice_per_step_with_a_loss_per_pair():
    """One model on two batches per step, a loss per pair ``(a[i], b[i])`` (a regression of
    the cosine similarity), Adam over steps: ``grad1[i]`` is pair ``i``'s gradient through
    both calls; and the DP step's norms are the pairs' own."""
    model = mlp()
    pair = Pair(model, cosine)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = lambda sim, t: (sim - t).square().mean()  # noqa: E731
    with gradhooks.add_hooks(model) as h:
        for step in range(2):
            (a, _), (b, _) = batch(step), batch(step + 10)
            target = torch.rand(4, dtype=D, generator=torch.Generator().manual_seed(step))
            want = {n[len("model.") :]: g for n, g in loop_grad(pair, loss, (a, b), target).items()}
            opt.zero_grad()
            loss(cosine(model(a), model(b)), target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
        (a, _), (b, _) = batch(5), batch(6)
        target = torch.rand(4, dtype=D, generator=torch.Generator().manual_seed(5))
        per = loop_grad(pair, loss, (a, b), target)
        norms = gradhooks.dp_sgd_step(
            h, (cosine(model(a), model(b)) - target).square(), max_norm=0.1, noise_multiplier=0.0
        )
        want = sum(g.flatten(1).square().sum(1) for g in per.values()).sqrt()
        torch.testing.assert_close(norms, want, rtol=1e-7, atol=1e-9)


class Unrolled(nn.Module):
    """A cell called once per time step, as many times as the input is long."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.cell, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):  # [batch, time, 3]
        h = x.new_zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(h) + self.inp(x[:, t]))
        return self.out(h)


def test_a_cell_called_as_many_times_as_the_input_is_long_over_steps():
    """A recurrence unrolled in Python to each batch's length (3, 5, then 1 steps): ``grad1``
    sums each example's gradient over every call of the cell, step after step."""
    model = Unrolled().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step, length in enumerate((3, 5, 1)):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, length, 3, generator=g, dtype=D), torch.randint(2, (4,))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"length {length}")
            opt.step()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.b(t)), self.a(x), use_reentrant=True)
        return self.c(h)


def test_reentrant_checkpointing_with_two_forwards_pending_then_both_backwards():
    """``checkpoint(..., use_reentrant=True)`` (older code's default), which runs the block
    again inside the backward: two micro-batches' forwards first, then their two backwards,
    then a new step; ``grad1`` holds each example's sum over both, then the step's own."""
    model = Checkpointed().double()
    (x, y), (x2, y2) = batch(0), batch(1)
    first, second = (
        loop_grad(model, F.cross_entropy, x, y),
        loop_grad(model, F.cross_entropy, x2, y2),
    )
    with gradhooks.add_hooks(model) as h:
        out, out2 = model(x), model(x2)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(out2, y2).backward()
        assert h.accumulated == 2
        assert_grad1(model, added(first, second), "two pending forwards")
        model.zero_grad()
        F.cross_entropy(model(x2), y2).backward()
        assert_grad1(model, second, "the next step")


# -- data pipelines ------------------------------------------------------------------------------


class PackedGRU(nn.Module):
    """Variable-length sequences through ``pack_padded_sequence`` (unsorted) into a GRU; the
    head reads the last state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.head = (
            nn.Linear(3, 4),
            nn.GRU(4, 5, batch_first=True),
            nn.Linear(5, 2),
        )

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence

        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][-1])


def test_packed_sequences_across_steps_with_different_lengths():
    """Padded batches of other lengths at each step, packed inside the model: each example's
    ``grad1`` is its gradient alone, without its padding (the loop runs each sequence at its
    own length)."""
    from torch.nn.utils.rnn import pad_sequence

    model = PackedGRU().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step, lengths in enumerate(([3, 5, 2, 4], [1, 2, 2], [6, 1, 3, 3, 2])):
            g = torch.Generator().manual_seed(step)
            seqs = [torch.randn(n, 3, generator=g, dtype=D) for n in lengths]
            y = torch.randint(2, (len(lengths),), generator=g)
            own = [
                loop_grad(model, F.cross_entropy, (s[None], torch.tensor([n])), y[i : i + 1])
                for i, (s, n) in enumerate(zip(seqs, lengths))
            ]
            want = {name: torch.cat([o[name] for o in own]) for name in own[0]}
            opt.zero_grad()
            x = pad_sequence(seqs, batch_first=True)
            F.cross_entropy(model(x, torch.tensor(lengths)), y).backward()
            assert_grad1(model, want, f"lengths {lengths}")
            opt.step()


class Bag(nn.Module):
    """Token embeddings averaged under the attention mask, a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(11, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask):
        e = self.emb(input_ids) * attention_mask[..., None]
        return self.head(e.sum(1) / attention_mask.sum(1, keepdim=True))


def test_a_collate_fn_returning_a_batch_encoding_passed_as_keywords():
    """A ``DataLoader`` whose ``collate_fn`` returns a Hugging Face ``BatchEncoding`` (the
    labels popped, the rest passed as ``model(**batch)``), the last batch short."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    model = Bag().double()
    rows = [
        {
            "input_ids": torch.randint(1, 11, (5,), generator=torch.Generator().manual_seed(i)),
            "attention_mask": (torch.arange(5) < 2 + i % 3).double(),
            "labels": torch.tensor(i % 2),
        }
        for i in range(7)
    ]

    def collate(items):
        return transformers.BatchEncoding(
            {k: torch.stack([it[k] for it in items]) for k in items[0]}
        )

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []
    with gradhooks.add_hooks(model):
        for b in DataLoader(rows, batch_size=3, collate_fn=collate):
            labels = b.pop("labels")
            want = loop_grad(model, F.cross_entropy, (b["input_ids"], b["attention_mask"]), labels)
            opt.zero_grad()
            F.cross_entropy(model(**b), labels).backward()
            assert_grad1(model, want, f"a batch of {len(labels)}")
            sizes.append(len(labels))
            opt.step()
    assert sizes == [3, 3, 1]


def test_non_contiguous_inputs():
    """Inputs that are views: transposed (``x.t()``), strided along the features and along
    the batch, expanded from one row, and a convolution's input permuted from NHWC, to a model
    in both memory formats: each the contiguous copy's ``grad1``."""
    model = mlp()
    y = torch.randint(2, (4,), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    views = {
        "x.t()": torch.randn(3, 4, generator=g, dtype=D).t(),
        "x[:, ::2]": torch.randn(4, 6, generator=g, dtype=D)[:, ::2],
        "x[::2]": torch.randn(8, 3, generator=g, dtype=D)[::2],
        "expand": torch.randn(3, generator=g, dtype=D).expand(4, 3),
    }
    with gradhooks.add_hooks(model):
        for what, x in views.items():
            assert not x.is_contiguous()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x.contiguous(), y), what)
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).double()
    x = torch.randn(4, 6, 6, 3, generator=g, dtype=D).permute(0, 3, 1, 2)
    want = loop_grad(cnn, F.cross_entropy, x.contiguous(), y)
    with gradhooks.add_hooks(cnn):
        for fmt in (torch.contiguous_format, torch.channels_last):
            cnn.to(memory_format=fmt).zero_grad()
            F.cross_entropy(cnn(x), y).backward()
            assert_grad1(cnn, want, f"NHWC permuted, the model in {fmt}")


# -- misuse: a clear error, or the documented meaning ---------------------------------------------


def test_train_and_eval_switched_between_the_forward_and_the_backward():
    """What a layer computes is fixed at its forward: a dropout forward in eval mode, then
    ``train()`` before the backward, is the eval model's gradient; a BatchNorm forward in eval
    mode (running statistics) likewise; a BatchNorm forward in train mode (batch statistics)
    is refused at once, naming the layer, and leaves nothing behind."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    model = model.double()
    x, y = batch(0, n=8)
    with torch.no_grad():
        model(x)  # (running statistics other than the initial ones)
    model.eval()
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        out = model(x)
        model.train()
        F.cross_entropy(out, y).backward()
        assert_grad1(model, want, "an eval forward, a backward in train mode")
        model.zero_grad()
        stats = copy.deepcopy(dict(model.named_buffers()))
        with pytest.raises(gradhooks.MixedExamplesError, match="'2' \\(BatchNorm1d\\)"):
            model(x)  # in train mode
        for name, kept in stats.items():  # (refused before the layer updated them)
            assert torch.equal(dict(model.named_buffers())[name], kept), name
        model.eval()
        F.cross_entropy(model(x), y).backward()  # nothing left of the refused forward
        assert_grad1(model, want, "the next forward, in eval mode")


def test_grad1_written_by_hand_is_added_to_as_grad_is():
    """``grad1`` changed by hand (``p.grad1 = 2 * p.grad1``, or in place) after a backward:
    the next backward of the accumulation adds to what is there, as autograd adds to a
    ``.grad`` written by hand; ``check()`` then reports that ``grad1`` no longer reduces to
    ``.grad``. ``del p.grad1`` starts it afresh (docs/training.md)."""
    model = mlp()
    (x, y), (x2, y2) = batch(0), batch(1)
    a, b = loop_grad(model, F.cross_entropy, x, y), loop_grad(model, F.cross_entropy, x2, y2)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            if n.endswith("weight"):
                p.grad1 = 2 * p.grad1
            else:
                p.grad1.mul_(2)
        F.cross_entropy(model(x2), y2).backward()
        assert_grad1(model, added(b, a, 2.0), "twice the first plus the second")
        report = h.check(raise_on_error=False)
        assert not report.ok and "differs from .grad" in str(report)
        for p in model.parameters():
            del p.grad1
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, a, "afresh after del")


def test_float64_inputs_to_a_float32_model_fail_in_torch_and_leave_nothing():
    """A float64 batch to a float32 model: torch's own dtype error at the first layer, the
    model as it was, and the next (float32) step's ``grad1`` its own."""
    model = mlp(torch.float32)
    before = copy.deepcopy(model.state_dict())
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(RuntimeError, match="dtype"):
            F.cross_entropy(model(x), y).backward()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert not any(hasattr(p, "grad1") or p.grad is not None for p in model.parameters())
        F.cross_entropy(model(x.float()), y).backward()
        want = loop_grad(copy.deepcopy(model).double(), F.cross_entropy, x, y)
        assert_grad1(model, want, "float32 step", rtol=1e-4, atol=1e-6)


def test_batch_dim_one_declared_on_batch_first_data_is_refused_naming_the_layer():
    """``add_hooks(model, batch_dim=1)`` on ``[batch, features]`` data: the features are no
    examples; refused at the backward, naming the layer, the sizes and ``batch_dim``."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, batch_dim=1):
        with pytest.raises(gradhooks.BatchNotFoundError, match="'2' \\(Linear\\).*batch_dim"):
            F.cross_entropy(model(x), y).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_hooks_on_submodules_and_a_backward_of_the_whole_model():
    """``add_hooks(model[2])`` (the head alone) and a backward of the whole model: the head's
    parameters get ``grad1``, the others none; one handle on each of two sibling layers gives
    every parameter its own, over steps of other sizes."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model[2]):
        F.cross_entropy(model(x), y).backward()
    want = loop_grad(model, F.cross_entropy, x, y)
    assert not hasattr(model[0].weight, "grad1")
    assert_grad1(model[2], {n[2:]: g for n, g in want.items() if n.startswith("2.")}, "head")
    with gradhooks.add_hooks(model[0]), gradhooks.add_hooks(model[2]):
        for n in (4, 3):
            x, y = batch(n, n=n)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), f"two handles, {n}")


class Masked(nn.Module):
    """Two Linear layers with ``how`` (a mask of the data against a statistic of the batch)
    on the input."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how, self.l1, self.l2 = how, nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(self.how(x))))


MASKS = {
    "x * (x > x.mean())": lambda x: x * (x > x.mean()),
    "float mask": lambda x: x * (x > x.mean()).to(x.dtype),
    "where x > median": lambda x: torch.where(x > x.median(), x, 0 * x),
    "where x > mean(0)": lambda x: torch.where(x > x.mean(0), x, 0 * x),
    "masked_fill": lambda x: x.masked_fill(x < x.mean(), 0.0),
    "top-k threshold": lambda x: x * (x >= x.flatten().topk(3).values[-1]),
    "median by quantile": lambda x: x * (x > torch.quantile(x, 0.5)),
    # (masks from indices computed across the batch, one entry per example)
    "capacity by cumsum": lambda x: x * ((x[:, :1] > 0).long().cumsum(0) <= 1),
    "the largest example": lambda x: x * (torch.arange(len(x))[:, None] == x[:, 0].argmax()),
    "rank below 3": lambda x: x * (x[:, 0].argsort().argsort()[:, None] < 3),
    # (one switch for the whole batch, decided across it: on for the batch, where an example
    # alone may not reach the count)
    "count-based switch": lambda x: x * ((x > 0).sum() > 5),
    "switch on the largest entry": lambda x: x * (x.abs().max() > 1.5),
}


@pytest.mark.parametrize("how", MASKS.values(), ids=list(MASKS))
def test_a_mask_of_the_data_against_a_statistic_of_the_batch_is_refused(how):
    """``x * (x > x.mean())``, or a mask that keeps the examples an index computed across the
    batch picks (an expert capacity counted over it, the largest example): which entries of an
    example it keeps depends on the other examples' values, so its gradient alone (the loop
    over batches of one) is not the batched forward's row, as for ``x - x.mean(0).detach()``.
    Refused at the forward, naming the layer, with or without the run-time check (which sees
    only the backward)."""
    model = Masked(how).double()
    x = torch.randn(6, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    rows = loop_grad(model, lambda out: out.square().sum(), x)
    with gradhooks.paused():
        model(x).square().sum().backward()  # (the batched forward's rows differ)
    assert not torch.allclose(rows["l1.weight"].sum(0), model.l1.weight.grad)
    model.zero_grad()
    for verify in (True, False):
        with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
            with pytest.raises(gradhooks.MixedExamplesError, match="'l1' \\(Linear\\).* across"):
                model(x)
    assert not any(hasattr(p, "grad1") or p.grad is not None for p in model.parameters())


def test_a_guard_that_holds_for_the_whole_batch_is_no_mixing():
    """``x * torch.isfinite(x).all()`` (a guard of the batch against overflow): where every
    entry of the batch is finite, so is every example's, and the guard keeps every entry, as a
    constant would: grad1 is the loop's."""
    model = Masked(lambda x: x * torch.isfinite(x).all()).double()
    x = torch.randn(6, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    want = loop_grad(model, lambda out: out.square().sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9)

"""Training frameworks' own loops: PyTorch Lightning's ``Trainer`` and PyTorch-Ignite's
supervised trainer run the forward, the backward, ``zero_grad`` and the optimizer's step
themselves, with their own habits (a loss scaled for accumulation, gradient clipping after the
backward, validation under ``no_grad``, float64 and bf16 precision plugins). At every training
step, ``grad1`` is compared with the float64 per-example loop at the parameters that step saw.
Each framework is skipped where it is not installed."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad

L = pytest.importorskip("lightning", reason="PyTorch Lightning is not installed")


def data(n: int = 24, seed: int = 0, dtype=torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)
    )


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


class Recorder:
    """What each training step's backward left: the parameters it ran at, its batch and each
    parameter's grad1 (copies)."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict, tuple, dict]] = []

    def keep(self, model: nn.Module, batch: tuple, params: dict) -> None:
        grad1 = {
            n: p.grad1.detach().clone() for n, p in model.named_parameters() if hasattr(p, "grad1")
        }
        self.steps.append((params, tuple(t.detach().clone() for t in batch), grad1))

    def check(
        self, model: nn.Module, scale: float = 1.0, rtol: float = 1e-9, atol: float = 1e-11
    ) -> None:
        """Each step's grad1 against the float64 loop at that step's parameters."""
        assert self.steps, "no training step was recorded"
        ref = copy.deepcopy(model).double()
        for k, (params, (x, y), grad1) in enumerate(self.steps):
            ref.load_state_dict({n: v.double() for n, v in params.items()})
            want = loop_grad(ref, F.cross_entropy, x.double(), y)
            assert set(grad1) == set(want), (
                f"step {k}: grad1 of {sorted(grad1)}, want {sorted(want)}"
            )
            for n, g in grad1.items():
                torch.testing.assert_close(
                    g.double(),
                    scale * want[n],
                    rtol=rtol,
                    atol=atol,
                    msg=f"step {k}, {n}",
                )


class Classifier(L.LightningModule):
    def __init__(self, recorder: Recorder, accumulate: int = 1, lr: float = 0.1) -> None:
        super().__init__()
        self.net = net()
        self.recorder = recorder
        self.lr = lr
        self.batch: tuple = ()
        self.params: dict = {}
        self.accumulate = accumulate

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.batch = batch
        if batch_idx % self.accumulate == 0:
            self.params = {n: p.detach().clone() for n, p in self.net.state_dict().items()}
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def on_after_backward(self):
        self.recorder.keep(self.net, self.batch, self.params)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def trainer(**kwargs) -> "L.Trainer":
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def fit(module, tr, train, val=None) -> None:
    with warnings.catch_warnings():
        # (Lightning's advice on the loaders' workers and the batch's size inference)
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        tr.fit(
            module,
            DataLoader(train, batch_size=6),
            None if val is None else DataLoader(val, batch_size=6),
        )


def test_lightning_float64_trainer_with_validation_between_epochs():
    """``precision="64-true"``: the model in float64, several epochs of SGD with momentum, a
    validation loop under ``no_grad`` after each: every step's grad1 is the loop's."""
    rec = Recorder()
    module = Classifier(rec)
    gradhooks.add_hooks(module.net)
    fit(
        module,
        trainer(max_epochs=2, precision="64-true", num_sanity_val_steps=1),
        data(),
        data(12, seed=1),
    )
    assert len(rec.steps) == 8
    rec.check(module.net)


def test_lightning_gradient_clipping_leaves_grad1_the_clipped_loss_s_own():
    """``gradient_clip_val``: Lightning clips ``.grad`` after the backward; grad1 stays the
    per-example gradients of the loss (what ``on_after_backward`` reads), and the hooks follow
    the next steps at the clipped update's parameters."""
    rec = Recorder()
    module = Classifier(rec, lr=1.0)
    gradhooks.add_hooks(module.net)
    fit(module, trainer(max_epochs=1, precision="64-true", gradient_clip_val=0.05), data())
    rec.check(module.net)


def test_lightning_accumulated_micro_batches_sum_as_grad_does():
    """``accumulate_grad_batches=2``: Lightning divides each micro-batch's loss by 2 and zeroes
    the gradients after every second; grad1 after the second backward holds, row by row, half
    the sum of the two micro-batches' per-example gradients, as ``.grad`` holds half their
    means' sum."""
    rec = Recorder()
    module = Classifier(rec, accumulate=2)
    h = gradhooks.add_hooks(module.net)
    fit(module, trainer(max_epochs=1, precision="64-true", accumulate_grad_batches=2), data())
    assert len(rec.steps) == 4
    ref = copy.deepcopy(module.net).double()
    for k in range(0, 4, 2):
        (p0, (x0, y0), first), (p1, (x1, y1), second) = rec.steps[k], rec.steps[k + 1]
        assert all(torch.equal(p0[n], p1[n]) for n in p0)  # (no step between them)
        ref.load_state_dict(p0)
        w0 = loop_grad(ref, F.cross_entropy, x0, y0)
        w1 = loop_grad(ref, F.cross_entropy, x1, y1)
        for n in first:
            torch.testing.assert_close(first[n], 0.5 * w0[n], rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(second[n], 0.5 * (w0[n] + w1[n]), rtol=1e-9, atol=1e-11)
    assert h.accumulated == 2


def test_lightning_bf16_mixed_precision_within_bf16_rounding():
    """``precision="bf16-mixed"`` (CPU autocast to bfloat16): grad1 against the float64 loop at
    the same parameters, within bf16's rounding (8 bits of mantissa: 2^-8 relative, a few
    roundings deep)."""
    rec = Recorder()
    module = Classifier(rec)
    gradhooks.add_hooks(module.net)
    fit(module, trainer(max_epochs=1, precision="bf16-mixed"), data())
    assert rec.steps and all(
        g.dtype == torch.float32 for _, _, g1 in rec.steps for g in g1.values()
    )
    ref = copy.deepcopy(module.net).double()
    for params, (x, y), grad1 in rec.steps:
        ref.load_state_dict({n: v.double() for n, v in params.items()})
        want = loop_grad(ref, F.cross_entropy, x.double(), y)
        for n, g in grad1.items():
            err = (g.double() - want[n]).norm() / want[n].norm().clamp_min(1e-12)
            assert err < 3e-2, f"{n}: relative error {err:.3g} under bf16"


class ManualDP(L.LightningModule):
    """Manual optimization: the per-example losses handed to gradhooks' DPOptimizer, whose
    step Lightning's optimizer wrapper calls."""

    def __init__(self, steps: list) -> None:
        super().__init__()
        self.net = net()
        self.automatic_optimization = False
        self.seen = steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        before = {n: p.detach().clone() for n, p in self.net.state_dict().items()}
        self.dp.backward(F.cross_entropy(self.net(x), y, reduction="none"))
        opt.step()  # (the noised, divided sum is in .grad from here)
        grads = {n: p.grad.detach().clone() for n, p in self.net.named_parameters()}
        self.seen.append((before, (x.detach().clone(), y.clone()), grads))

    def configure_optimizers(self):
        self.hooks = gradhooks.add_hooks(self.net, quantities=("norms",))
        self.dp = gradhooks.DPOptimizer(
            torch.optim.SGD(self.net.parameters(), lr=0.5), self.hooks, max_grad_norm=0.3,
            noise_multiplier=0.0, expected_batch_size=6,
        )  # fmt: skip
        return self.dp


def test_lightning_manual_optimization_with_the_dp_optimizer():
    """A DP-SGD step inside Lightning's manual optimization: after ``dp.backward(losses)`` and
    Lightning's ``opt.step()`` (which passes the DPOptimizer a closure), ``.grad`` is the sum of
    the per-example gradients clipped to 0.3, divided by the expected batch size (noise 0 here,
    to compare), each step at the parameters Lightning's loop reached."""
    seen: list = []
    module = ManualDP(seen)
    fit(module, trainer(max_epochs=1, precision="64-true"), data())
    assert len(seen) == 4
    ref = copy.deepcopy(module.net).double()
    for before, (x, y), grads in seen:
        ref.load_state_dict(before)
        g1 = loop_grad(ref, F.cross_entropy, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in g1.values()]).sum(0).sqrt()
        factor = (0.3 / norms).clamp(max=1.0)
        for n, g in g1.items():
            want = torch.einsum("b,b...->...", factor, g) / 6
            torch.testing.assert_close(grads[n], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ignite_supervised_trainer(accumulation):
    """Ignite's ``create_supervised_trainer`` (its own zero_grad, loss / accumulation steps,
    backward and step): each iteration's grad1, read at ``ITERATION_COMPLETED``, against the
    float64 loop at the parameters of ``ITERATION_STARTED``, scaled as its loss is and summed
    over the micro-batches it accumulates."""
    pytest.importorskip("ignite", reason="PyTorch-Ignite is not installed")
    from ignite.engine import Events, create_supervised_trainer

    model = net().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    h = gradhooks.add_hooks(model)
    engine = create_supervised_trainer(
        model, opt, F.cross_entropy, gradient_accumulation_steps=accumulation
    )
    seen: list = []

    @engine.on(Events.ITERATION_STARTED)
    def before(e):
        if (e.state.iteration - 1) % accumulation == 0:
            seen.append(({n: p.detach().clone() for n, p in model.state_dict().items()}, []))

    @engine.on(Events.ITERATION_COMPLETED)
    def after(e):
        x, y = e.state.batch
        seen[-1][1].append(
            ((x.clone(), y.clone()), {n: p.grad1.clone() for n, p in model.named_parameters()})
        )

    engine.run(DataLoader(data(dtype=torch.float64), batch_size=6), max_epochs=2)
    assert len(seen) == 8 // accumulation
    for params, micro in seen:
        ref = copy.deepcopy(model)
        ref.load_state_dict(params)
        total = None
        for (x, y), grad1 in micro:
            want = {n: g / accumulation for n, g in loop_grad(ref, F.cross_entropy, x, y).items()}
            total = want if total is None else {n: total[n] + want[n] for n in want}
            for n, g in grad1.items():
                torch.testing.assert_close(g, total[n], rtol=1e-9, atol=1e-11)
    assert h.accumulated == accumulation


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_lightning_fabric_setup_and_backward(when, precision):
    """Lightning Fabric: ``fabric.setup(model, opt)`` wraps the model (and converts it to the
    precision's dtype) and ``fabric.backward(loss)`` runs the backward; the hooks added to the
    model before ``setup`` or to the wrapper after it. Fabric hands the loss a float32 output
    under ``"64-true"``, so grad1 is compared within float32's rounding there (bf16's under
    ``"bf16-mixed"``), each of three SGD steps at its own parameters."""
    from lightning.fabric import Fabric

    model = net()
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    if when == "before":
        gradhooks.add_hooks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped, opt = fabric.setup(model, opt)
    if when == "after":
        gradhooks.add_hooks(wrapped)
    tol = 1e-5 if precision == "64-true" else 3e-2
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        want = loop_grad(copy.deepcopy(model).double(), F.cross_entropy, x.double(), y)
        opt.zero_grad()
        fabric.backward(F.cross_entropy(wrapped(x), y))
        for n, p in model.named_parameters():
            err = (p.grad1.double() - want[n]).norm() / want[n].norm()
            assert err < tol, f"step {step}, {n}: relative error {err:.3g}"
        opt.step()

"""gradhooks down the paths it takes on a GPU, run on the CPU.

Where the device decides (:mod:`gradhooks.devices`), gradhooks takes other paths on a CUDA
tensor than on a CPU one: nothing read back to the host (the embeddings' rows compacted by a
sort rather than ``torch.unique``, no spot check between the full checks), no Linear,
convolution or self-attention run detached to take ``.grad`` from ``grad1``, no grouped form of
a convolution, no transposed product for a narrow input. The ``device_like`` fixture
(``tests/conftest.py``) makes the CPU take those paths; these tests run representative models
so, for ``grad1``, the norms, the DP step by each method and bfloat16 autocast, against the
float64 per-example loop, on every run. (``GRADHOOKS_TEST_DEVICE_LIKE=1`` runs the whole suite
so.)

Each model is built to reach the CPU-only paths on the CPU: 40 positions per example (the
threshold of a Linear run detached is 32), a Linear of 4 input features to 24 (the narrow
input), a convolution of 72 columns over 64 positions (the grouped form), positions looked up
once for the whole batch and tokens hit twice by an example (the rows' compaction).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_autocast import TOL, rel_err
from test_host_syncs import Positions
from torch import Tensor, nn

import gradhooks
import gradhooks.devices
from gradhooks.oracle import loop_grad
from harness import assert_close, hf

BATCH = 3


class Tokens(nn.Module):
    """A Linear of 4 features to 24 over 40 positions, a self-attention over them and a head
    on their mean."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 24)
        self.attention = nn.MultiheadAttention(24, 2, batch_first=True)
        self.head = nn.Linear(24, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.up(x))
        h = h + self.attention(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class Convs(nn.Module):
    """Two convolutions (8 channels of 8x8 to 6, 3x3: 72 columns over 64 positions; then 6 to
    4, stride 2) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(8, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 4, 3, stride=2)
        self.head = nn.Linear(4 * 9, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.c2(torch.relu(self.c1(x))).flatten(1))


class Recurrent(nn.Module):
    """An LSTM of 4 features to 6 over 5 steps and a head on the last."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Logits(nn.Module):
    """A Hugging Face model's logits, at the last position (a sequence model's)."""

    def __init__(self, model: nn.Module, last: bool) -> None:
        super().__init__()
        self.model, self.last = model, last

    def forward(self, ids: Tensor) -> Tensor:
        logits = self.model(input_ids=ids).logits
        return logits[:, -1] if self.last else logits


def _gpt2() -> nn.Module:
    config = hf("GPT2Config")(
        n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=11, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Logits(hf("GPT2LMHeadModel")(config), last=True)


def _bert() -> nn.Module:
    config = hf("BertConfig")(
        vocab_size=11, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return Logits(hf("BertForSequenceClassification")(config), last=False)


def _ids(length: int) -> Callable[[int], Tensor]:
    """Token ids ``[batch, length]`` of 11 tokens, token 3 at least twice in every example."""

    def ids(batch: int) -> Tensor:
        t = torch.randint(0, 11, (batch, length))
        t[:, :2] = 3
        return t

    return ids


def _per_example_ce(out: Tensor, y: Tensor) -> Tensor:
    """Each example's cross-entropy, ``[batch]`` (averaged over positions for ``[batch,
    positions, classes]``)."""
    if out.dim() == 2:
        return F.cross_entropy(out, y, reduction="none")
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


@dataclass
class Model:
    id: str
    make: Callable[[], nn.Module]
    inputs: Callable[[int], Tensor]
    target: Callable[[int], Tensor]

    def __repr__(self) -> str:
        return self.id


def _classes(batch: int) -> Tensor:
    return torch.randint(0, 3, (batch,))


MODELS = [
    Model("tokens", Tokens, lambda b: torch.randn(b, 40, 4), _classes),
    Model("convs", Convs, lambda b: torch.randn(b, 8, 8, 8), _classes),
    Model("lstm", Recurrent, lambda b: torch.randn(b, 5, 4), _classes),
    Model("embeddings", Positions, _ids(6), lambda b: torch.randint(0, 11, (b, 6))),
    Model("gpt2", _gpt2, _ids(8), lambda b: torch.randint(0, 11, (b,))),
    Model("bert", _bert, _ids(8), _classes),
]


def _setup(m: Model, dtype: torch.dtype = torch.float64):
    """The model (seeded, in ``dtype``), its inputs and targets, and the float64 loop's
    per-example gradients of each example's loss."""
    torch.manual_seed(0)
    model = m.make().to(dtype)
    x, y = m.inputs(BATCH), m.target(BATCH)
    if x.is_floating_point():
        x = x.to(dtype)
    reference = m.make().double()  # (the same seed: the same parameters)
    reference.load_state_dict(model.state_dict())
    xd = x.double() if x.is_floating_point() else x
    want = loop_grad(reference, lambda out, t: _per_example_ce(out, t).sum(), xd, y)
    return model, x, y, want


def _norms(want: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


@pytest.mark.parametrize("m", MODELS, ids=repr)
def test_grad1_and_norms_down_the_device_paths(device_like, m):
    model, x, y, want = _setup(m)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        _per_example_ce(model(x), y).sum().backward()
        for name, p in model.named_parameters():
            assert_close(p.grad1, want[name], f"{m.id}: {name}")
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        for step in range(3):  # (the 3rd backward is not verified)
            model.zero_grad()
            _per_example_ce(model(x), y).sum().backward()
            assert_close(h.norms(), _norms(want), f"{m.id}: norms at backward {step + 1}")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("m", MODELS, ids=repr)
def test_the_dp_step_down_the_device_paths(device_like, m, method):
    """Clipping only (no noise): each example's gradient clipped to the bound, summed, over
    the batch size. The bound is the median norm: some examples are clipped, some not."""
    model, x, y, want = _setup(m)
    norms = _norms(want)
    bound = float(norms.median())
    factors = (bound / norms).clamp(max=1.0)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        got = gradhooks.dp_sgd_step(
            h, _per_example_ce(model(x), y), max_norm=bound, noise_multiplier=0.0, method=method
        )
    assert_close(got, norms, f"{m.id}: the step's norms")
    for name, p in model.named_parameters():
        clipped = torch.einsum("b,b...->...", factors, want[name]) / BATCH
        assert_close(p.grad, clipped, f"{m.id} ({method}): {name}")


@pytest.mark.parametrize("m", [m for m in MODELS if m.id != "lstm"], ids=repr)
def test_bfloat16_autocast_down_the_device_paths(device_like, m):
    """A float32 model under CPU autocast to bfloat16: ``grad1`` and the norms against the
    float64 loop within ``test_autocast.TOL`` (about 16 units of bfloat16), or three times the
    error of autograd's own ``.grad`` in the same backward where that is larger (a ReLU whose
    inputs near zero change sign in bfloat16 moves the gradient by more: 10% for the
    convolutions' first layer here). The LSTM is left out: oneDNN has no bfloat16 LSTM on some
    CPUs."""
    model, x, y, want = _setup(m, torch.float32)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        _per_example_ce(out.float(), y).sum().backward()
        worst = TOL[torch.bfloat16]
        for name, p in model.named_parameters():
            tol = max(TOL[torch.bfloat16], 3 * rel_err(p.grad, want[name].sum(0)))
            worst = max(worst, tol)
            err = rel_err(p.grad1, want[name])
            assert err <= tol, f"{m.id}: {name}: relative error {err:.2e} > {tol:.2e}"
        err = rel_err(h.norms(), _norms(want))
        assert err <= worst, f"{m.id}: norms: relative error {err:.2e} > {worst:.2e}"


def test_the_fixture_sends_every_question_down_the_device_paths(device_like):
    t = torch.zeros(2)
    assert not gradhooks.devices.reads_are_free(t)
    assert not gradhooks.devices.cpu_trade_offs(t)


# -- every device question is asked of gradhooks.devices ----------------------------------------

PACKAGE = Path(gradhooks.__file__).resolve().parent
ASKS_CPU = re.compile(r"""device\.type\s*[!=]=\s*["']cpu["']|\.is_cpu\b""")

# What asks the device a tensor is on for a fact, not to choose a path (files, by count): the
# rounding of the CPU LayerNorm kernel that ran, the device's memory, a generator's device,
# and whether a 0-dim scale may be a CPU tensor.
FACTS = {
    "engine/memory.py": 1,
    "pieces.py": 1,
    "privacy/sampling.py": 1,
    "rules/norm.py": 1,
    "workflows/private.py": 1,
}


def test_every_path_chosen_by_the_device_asks_gradhooks_devices():
    """A branch on ``device.type == "cpu"`` or ``.is_cpu`` outside :mod:`gradhooks.devices`
    would not follow the ``device_like`` fixture: the GPU's side of it would never run here."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "devices.py":
            continue
        n = len(ASKS_CPU.findall(path.read_text()))
        if n:
            found[name] = n
    assert found == FACTS, (
        "a path chosen by the device should ask gradhooks.devices (reads_are_free, "
        f"cpu_trade_offs); a question of fact belongs in FACTS: {found}"
    )

"""Hugging Face architectures that the other tests do not build by hand, through
``bench.hf_sweep``: a tiny random configuration of each, in float64 and training mode (dropout
0), whose ``grad1`` must equal, parameter by parameter, each example's own gradient by a loop
of batches of one (``rtol=1e-7``; ``1e-4`` where the model computes in float32 inside, which
the sweep measures and says). The sweep itself is checked to tell a wrong ``grad1`` and a
refusal apart from a match, and to write its table."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers", reason="the sweep needs transformers")
hf_sweep = pytest.importorskip("bench.hf_sweep")

import gradhooks  # noqa: E402
from harness import corrupting  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


# One model per family, each of a kind the hand-written tests do not build: rotary decoders
# with grouped, multi-query or parallel attention, ALiBi, convolutional and state-space
# layers, hierarchical vision models, audio encoders.
FAMILIES = [
    "mistral",  # grouped-query attention, sliding window
    "qwen3",  # q/k norms
    "gemma2",  # soft-capped logits, pre- and post-norms, tied embeddings scaled
    "phi",  # partial rotary, parallel attention and MLP
    "phi3",  # fused qkv and gate-up projections
    "falcon",  # multi-query attention, parallel blocks
    "gpt_neox",  # fused qkv split per head
    "gptj",  # interleaved rotary
    "bloom",  # ALiBi biases
    "mpt",  # ALiBi, no biases
    "stablelm",  # LayerNorm with partial rotary
    "olmo2",  # norms after attention and MLP
    "electra",  # generator head with its own embedding projection
    "modernbert",  # alternating global and local attention, unpadding
    "convnext",  # depthwise convolutions, LayerNorm over channels
    "dinov2",  # layer scale, mask token
    "segformer",  # overlapping patch merging, efficient attention
    "wav2vec2",  # convolutional feature encoder, positional convolution (weight norm)
    "mamba",  # selective scan
    "reformer",  # reversible layers, whose autograd.Function runs a backward into .grad
]


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_matches_the_loop(family):
    res = hf_sweep.check(family, limit=0)
    assert res.outcome == "match", (res.outcome, res.detail)
    assert res.params > 0 and not res.warnings


def test_loop_puts_back_each_grad():
    """The loop reads each example's gradient from ``.grad`` (a reversible layer's own backward
    writes it there, unseen by ``autograd.grad``) and leaves ``.grad`` as it found it."""
    name, model, config = hf_sweep.build("gpt2", None)
    batch = hf_sweep.inputs(model, config, name)
    labels = torch.randint(0, hf_sweep.VOCAB, (hf_sweep.BATCH, hf_sweep.SEQ))
    params = list(model.named_parameters())
    kept = {n: torch.full_like(p, 7.0) for n, p in params}
    for n, p in params:
        p.grad = kept[n]
    got = hf_sweep.loop_grads(model, batch, labels, params)
    assert all(p.grad is kept[n] for n, p in params)
    model.zero_grad(set_to_none=True)
    hf_sweep.summed_loss(model, batch, labels, False).backward()
    for n, p in params:
        torch.testing.assert_close(got[n].sum(0), p.grad, rtol=1e-9, atol=1e-12)


def test_padded_batch_matches_the_loop():
    """Right padding of different lengths: pooling at the last real token (a decoder's
    sequence classifier) reads each example's own row."""
    res = hf_sweep.check("qwen2", task="sequence-classification", limit=0, padded=True)
    assert res.outcome == "match", (res.outcome, res.detail)


def test_own_loss_matches_the_loop():
    """The model's own loss of its labels (an average, computed by Hugging Face in float32)."""
    res = hf_sweep.check("phi3", limit=0, own_loss=True)
    assert res.outcome == "match", (res.outcome, res.detail)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_router_balancing_loss_is_refused_or_right(family):
    """The load-balancing loss of a mixture of experts (``output_router_logits=True``) is a
    product of two averages over every token of the batch, one of them a count without a
    gradient weighting each expert: no sum of per-example losses. Before, grad1 of the routers
    was written without a refusal (0.9% to 116% off the loop); now the backward is refused,
    naming the router."""
    res = hf_sweep.check(family, limit=0, router_loss=True)
    assert res.outcome in ("match", "refused"), (res.outcome, res.detail)
    assert res.outcome == "match" or (".mlp.gate" in res.detail and "couples" in res.detail)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_router_without_its_balancing_loss_matches_the_loop(family):
    """The same models with their own loss of the labels and no load-balancing term."""
    res = hf_sweep.check(family, limit=0, own_loss=True)
    assert res.outcome == "match", (res.outcome, res.detail)


def test_sweep_reports_a_wrong_grad1_as_mismatch(monkeypatch):
    monkeypatch.setattr(hf_sweep.gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    res = hf_sweep.check("gpt2", limit=0)
    assert res.outcome == "mismatch"
    assert res.parameter and res.max_rel_error > 1e-3


def test_sweep_reports_a_refusal_with_its_first_line(monkeypatch):
    def refuse(model, **kwargs):
        raise gradhooks.UnsupportedModuleError("no rule for this model\nsecond line")

    monkeypatch.setattr(hf_sweep.gradhooks, "add_hooks", refuse)
    res = hf_sweep.check("gpt2", limit=0)
    assert (res.outcome, res.detail) == (
        "refused",
        "UnsupportedModuleError: no rule for this model",
    )


def test_sweep_reports_a_failure_inside_gradhooks_as_crash(monkeypatch):
    from gradhooks.engine import handle

    def broken(*args, **kwargs):
        raise KeyError("broken")

    monkeypatch.setattr(handle.Hooks, "__init__", broken)
    res = hf_sweep.check("gpt2", limit=0)
    assert res.outcome == "crash" and "KeyError" in res.detail


def test_sweep_runs_and_writes_its_table(tmp_path, capsys):
    assert hf_sweep.main(["--families", "llama,vit", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hf-sweep.json").read_text())
    assert data["counts"] == {"match": 2, "refused": 0, "mismatch": 0, "crash": 0, "skipped": 0}
    assert {r["family"]: r["outcome"] for r in data["results"]} == {
        "llama": "match",
        "vit": "match",
    }
    table = (tmp_path / "hf-sweep.md").read_text()
    assert "| llama | causal-lm | LlamaForCausalLM |" in table
    assert "| match | 2 |" in table
    assert "2 match" in capsys.readouterr().out


def test_sweep_tiny_config_sets_the_sizes_the_config_has():
    config = hf_sweep.tiny_config("mistral")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 99)
    assert config.attention_dropout == 0.0
    assert torch.get_default_dtype() == torch.float32  # nothing global changed


def test_sweep_counts_a_model_too_large_before_making_it(monkeypatch):
    """A model above the sweep's size is counted on the meta device and skipped without its
    memory taken (T5Gemma's tiniest configuration makes 5.6 billion parameters)."""
    import transformers

    devices = []
    init = transformers.LlamaForCausalLM.__init__

    def spied(self, config):
        devices.append(torch.empty(()).device.type)  # the device it is made on
        init(self, config)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", spied)
    monkeypatch.setattr(hf_sweep, "MAX_PARAMS", 1000)
    res = hf_sweep.check("llama", limit=0)
    assert res.outcome == "skipped" and "parameters at the tiniest config" in res.detail
    assert devices == ["meta"]


def test_an_expert_that_takes_every_token_weighted_by_its_scores_matches():
    """AFMoE's experts: in a tiny batch one expert is routed every token, so the rows it
    computed (with a gradient) are the batch's in order, and their product with the router's
    scores looks like a mask laid along the examples; a mask has no gradient, and this is no
    mask (it was refused as mixing the examples)."""
    res = hf_sweep.check("afmoe", limit=0)
    assert res.outcome == "match", (res.outcome, res.detail)


@pytest.mark.parametrize(
    "setting", ["training", "bf16-autocast", "fp16-scaler", "dp-step", "dp-fp16-scaler"]
)
def test_architecture_in_another_setting(setting):
    """3 SGD steps (grad1 of each against the loop at that step's parameters), bfloat16
    autocast (against the float64 loop, relative error at most 5e-2), float16 autocast with a
    GradScaler (grad1 divided by its scale, at most 1e-2), a DP step (p.grad against the loop's
    clipped sum), and the DP step under float16 autocast with the scaler passed to it."""
    res = hf_sweep.check("llama", limit=0, setting=setting)
    assert (res.task, res.model) == (setting, "LlamaForCausalLM")
    assert res.outcome == "match", (res.outcome, res.detail)
    if "fp16" in setting:
        assert "divided by the scaler's scale" in res.detail


@pytest.mark.parametrize(
    "family, setting",
    [("opt", "bf16-autocast"), ("convnext", "dp-fp16-scaler")],
)
def test_setting_allows_the_models_own_rounding(family, setting):
    """OPT under bfloat16 autocast: its own bfloat16 loop, without gradhooks, is off the
    float64 loop by 0.15 at a weight, which is allowed 5e-2 plus twice that. ConvNeXt's DP
    step under float16 with a GradScaler: autograd's own clipped sum of the scaled losses,
    without gradhooks, is off the loop by 0.044 of a LayerNorm bias's largest term, which is
    allowed 1e-2 plus twice that."""
    res = hf_sweep.check(family, limit=0, setting=setting)
    assert res.outcome == "match", (res.outcome, res.detail)
    assert "without gradhooks" in res.detail


def test_dp_setting_of_a_model_that_rounds_in_float32_inside():
    """Qwen3-Next's gated delta rule rounds in float32 inside: the DP step, which takes the
    losses' sum, gives the loop's clipped sum within 1e-6 of its largest term, with no
    allowance (taking their mean, it was off by more than that, within ten times autograd's
    own error there, 2.5e-5)."""
    res = hf_sweep.check("qwen3_next", limit=0, setting="dp-step")
    assert res.outcome == "match", (res.outcome, res.detail)
    assert "without gradhooks" not in res.detail and res.max_rel_error < 1e-6, res.detail


class BatchedOtherwise(nn.Module):
    """A Linear, tanh, a Linear; a batch of more than one example has its hidden layer scaled
    by 1.5, no gradient of its own: a batch computed otherwise than each example alone, as
    torch's CPU bfloat16 convolution of the channels-last view that Segformer's and PVT's
    sequence reductions read does on some machines."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h * 1.5 if x.shape[0] > 1 else h)


def _subject(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """``model`` on ``x`` with a summed cross-entropy of ``y``, as the settings run it."""
    from bench import sweep

    def losses():
        return F.cross_entropy(model(x).float(), y, reduction="none")

    def own_gradients():
        params = [p for _, p in sweep.trainable(model)]
        rows = [torch.autograd.grad(losses_of(b), params) for b in range(len(x))]
        return {n: torch.stack([r[i] for r in rows])
                for i, (n, _) in enumerate(sweep.trainable(model))}  # fmt: skip

    def losses_of(b):
        return F.cross_entropy(model(x[b : b + 1]).float(), y[b : b + 1], reduction="sum")

    return sweep.Subject(
        model,
        loss=lambda: losses().sum(),
        losses=losses,
        own_gradients=own_gradients,
        lowered=lambda: _subject(copy.deepcopy(model).float(), x.float(), y),
    )


def _batched_otherwise():
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    return _subject(BatchedOtherwise().double(), x, torch.tensor([0, 2, 1]))


def test_bf16_setting_tells_a_batch_computed_otherwise_from_a_wrong_grad1():
    """The model's batched forward is not each example's alone: grad1 is off the float64
    loop by far more than bfloat16 allows, and so are autograd's own per-example gradients
    of the batched forward, without gradhooks; grad1 is compared with those, and matches."""
    from bench import sweep

    res = sweep.Result("batched-otherwise")
    sweep.bf16_autocast(_batched_otherwise(), res)
    assert res.outcome == "match", (res.outcome, res.detail)
    assert "batched bfloat16 forward" in res.detail and res.max_rel_error <= sweep.BF16_TOL


def test_bf16_setting_reports_a_wrong_grad1_of_a_batch_computed_otherwise(monkeypatch):
    """The same model with two examples' grad1 swapped: wrong against autograd's per-example
    gradients of the batched forward too."""
    from bench import sweep

    monkeypatch.setattr(sweep.gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    res = sweep.Result("batched-otherwise")
    sweep.bf16_autocast(_batched_otherwise(), res)
    assert res.outcome == "mismatch", (res.outcome, res.detail)


def test_training_setting_reports_a_grad1_that_zero_grad_did_not_reset(monkeypatch):
    """The training setting leaves each step's grad1 where the backward wrote it: a grad1
    that goes on accumulating after zero_grad is wrong at the second step."""
    from gradhooks.engine import accumulation

    monkeypatch.setattr(accumulation.GradTrail, "restarted", lambda self: [])
    res = hf_sweep.check("llama", limit=0, setting="training")
    assert res.outcome == "mismatch", (res.outcome, res.detail)
    assert res.detail.startswith("step 2:")


def test_settings_report_a_wrong_grad1_as_mismatch(monkeypatch):
    monkeypatch.setattr(hf_sweep.gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    res = hf_sweep.check("gpt2", limit=0, setting="bf16-autocast")
    assert res.outcome == "mismatch", (res.outcome, res.detail)


def test_fp16_setting_divides_grad1_by_the_scale(monkeypatch):
    """grad1 under the scaler is the scale times each example's gradient, and the setting
    compares it divided by that scale (which matches: the architectures' test above): a
    backward scaled by twice the scale the scaler says is a mismatch."""
    from bench import sweep

    real = torch.amp.GradScaler

    class Twice(real):
        def scale(self, outputs):
            return super().scale(outputs) * 2

    monkeypatch.setattr(sweep.torch.amp, "GradScaler", Twice)
    res = hf_sweep.check("gpt2", limit=0, setting="fp16-scaler")
    assert res.outcome == "mismatch", (res.outcome, res.detail)


def test_sweep_in_settings_writes_its_counts(tmp_path, capsys):
    argv = ["--families", "vit", "--settings", "training,dp-step", "--out", str(tmp_path)]
    assert hf_sweep.main(argv) == 0
    data = json.loads((tmp_path / "hf-sweep-settings.json").read_text())
    assert data["counts"]["match"] == 1
    assert set(data["settings_counts"]) == {"training", "dp-step"}
    assert all(c["match"] == 1 for c in data["settings_counts"].values())
    assert [r["task"] for r in data["settings"]] == ["training", "dp-step"]
    table = (tmp_path / "hf-sweep-settings.md").read_text()
    assert "| vit | training | ViTForImageClassification | match |" in table
    assert "training: 1 match" in capsys.readouterr().out


def test_dp_fp16_setting_reports_a_clipped_sum_left_scaled(monkeypatch):
    """The DP step's p.grad is written scaled for scaler.step to unscale: compared as if the
    scale were twice what it was, it is a mismatch."""
    from bench import sweep

    real = torch.amp.GradScaler

    class Halved(real):
        def get_scale(self):
            return super().get_scale() * 2

    monkeypatch.setattr(sweep.torch.amp, "GradScaler", Halved)
    res = hf_sweep.check("gpt2", limit=0, setting="dp-fp16-scaler")
    assert res.outcome == "mismatch", (res.outcome, res.detail)

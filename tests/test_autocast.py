"""Every rule and every quantity under CPU autocast (bfloat16, float16) and with bfloat16
parameters, against the float64 per-example loop.

Tolerances, as a relative error ``max|got - ref| / max|ref|`` per parameter: the forward runs
in the low precision, so each output-gradient carries a few roundings of the format's unit
(bfloat16 keeps 8 significant bits, ``u = 2⁻⁹ ≈ 2e-3``; float16 11, ``u = 2⁻¹² ≈ 2.4e-4``)
through a few layers, each example's gradient summing over positions whose errors do not
cancel. ``TOL`` allows about 16 units for the small models here (``5e-2`` for bfloat16,
``1e-2`` for float16); an error of the rules (a piece of the wrong example, a lost scale, a
transposed product) is of the order of the gradient itself (relative error ~1) and fails.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import CASES_BY_LAYER
from test_fallback import CASES as ALL_FALLBACK_CASES
from test_fallback import _only
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import Case, _double

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 5e-2, FP16: 1e-2}
BATCH = 3


def _floated(out):
    """The model's output(s) in float32 (a loss in bfloat16 would round it once more)."""
    if isinstance(out, tuple | list):
        return type(out)(_floated(t) for t in out)
    return out.float() if isinstance(out, Tensor) and out.is_floating_point() else out


def rel_err(got: Tensor, ref: Tensor, scale: float | None = None) -> float:
    """``max|got - ref| / max|ref|`` in float64 (or over ``scale``)."""
    if scale is None:
        scale = float(ref.abs().max()) if ref.numel() else 0.0
    diff = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
    return diff / scale if scale else diff


def _setup(case: Case, seed: int = 0, loop: bool = True):
    """The case's float32 model, inputs and target (seeded), and the float64 loop's
    per-example gradients (``loop``)."""
    torch.manual_seed(seed)
    model = _float32(case)
    model.zero_grad(set_to_none=True)
    gradhooks.clear_grad1(model)
    inputs = case.inputs(BATCH)
    target = case.target(BATCH) if case.target else None
    ref = None
    if loop:
        ref_model = copy.deepcopy(model).double()
        ref = loop_grad(ref_model, case.loss, _double(inputs), target)
    return model, inputs, target, ref


def _float32(case: Case) -> nn.Module:
    """The case's model in float32 (some cases build their layers once, and another test may
    have left them in float64)."""
    return case.model().float()


def _loss(case: Case, out, target):
    out = _floated(out)
    return case.loss(out) if target is None else case.loss(out, target)


def hooked(
    case: Case, model, inputs, target, dtype, quantities, backward_inside=False, **hook_kwargs
):
    """One forward under autocast to ``dtype`` (``None``: none) and a sum-reduced backward,
    hooked."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    h = gradhooks.add_hooks(model, loss_reduction="sum", quantities=quantities, **hook_kwargs)
    with h:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(*args)
            if backward_inside:
                _loss(case, out, target).backward()
        if not backward_inside:
            _loss(case, out, target).backward()
    return h


def _assert_rel(
    got: Tensor, ref: Tensor, tol: float, what: str, scale: float | None = None
) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = rel_err(got, ref, scale)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _assert_batch_grad(got: Tensor, per_example: Tensor, tol: float, what: str) -> None:
    """``got`` against the sum of ``per_example`` over the examples. A sum's rounding scales
    with its terms, not with what is left of them where they cancel (the inputs are drawn
    differently on different processors, and some draws cancel to a twentieth): the error is
    measured against the largest sum of the terms' magnitudes."""
    scale = float(per_example.abs().sum(0).max()) if per_example.numel() else 0.0
    _assert_rel(got, per_example.sum(0), tol, what, scale)


def _runs(case: Case, dtype) -> bool:
    """Whether torch itself runs the case's forward and backward under autocast to ``dtype`` on
    this CPU (oneDNN has no float16 LSTM on CPUs without AVX-512 FP16)."""
    torch.manual_seed(0)
    model, inputs = _float32(case), case.inputs(2)
    target = case.target(2) if case.target else None
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        _loss(case, out, target).backward()
    except RuntimeError as e:
        if "could not create a primitive" in str(e):
            return False
        raise
    return True


CASES = [
    pytest.param(case, id=case.id)
    for cases in CASES_BY_LAYER.values()
    for case in cases[:1]  # one case per layer type (the Linear's second: positions)
] + [pytest.param(CASES_BY_LAYER[nn.Linear][2], id="linear_seq_gram"),
     pytest.param(CASES_BY_LAYER[nn.Linear][5], id="reused_linear_seq"),
     pytest.param(CASES_BY_LAYER[nn.Linear][6], id="tied_linear")]  # fmt: skip
FALLBACK_CASES = [
    c for c in ALL_FALLBACK_CASES if c.id in ("custom_layer", "buffers", "multihead_attention")
]
DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")]

SOME = ["mlp", "conv_net", "linear_seq_gram", "multihead_attention", "lstm",
        "transformer_encoder_layer", "embedding", "layer_norm"]  # fmt: skip


def _case(case_id: str) -> Case:
    return next(c for cases in CASES_BY_LAYER.values() for c in cases if c.id == case_id)


_REFERENCES: dict[str, tuple] = {}
_TOLERANCES: dict[tuple[str, torch.dtype], dict[str, float]] = {}


def _tolerances(case: Case, dtype: torch.dtype) -> dict[str, float]:
    """Per parameter, the tolerance of the case's seeded draw under autocast to ``dtype``:
    ``TOL``, or three times torch's own error if that is larger. Where the terms of a gradient
    cancel (over the examples, the positions, or a LayerNorm's features upstream), the
    roundings of the output-gradients in the half precision leave more of the result than
    ``TOL`` allows: the relative error of plain autograd's ``.grad`` (no hooks) against the
    float64 loop's sum reached 8% in float16 on some draws of a Transformer layer. The inputs
    are drawn differently on different processors, so which draw a test gets is not fixed."""
    key = (case.id, dtype)
    if key not in _TOLERANCES:
        ref, _ = _reference(case)
        model, inputs, target, _ = _setup(case, loop=False)
        with torch.autocast("cpu", dtype=dtype):
            out = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        _loss(case, out, target).backward()
        _TOLERANCES[key] = {
            name: max(TOL[dtype], 3 * rel_err(p.grad, ref[name].sum(0)))
            for name, p in model.named_parameters()
        }
    return _TOLERANCES[key]


def _reference(case: Case):
    """The float64 loop's per-example gradients of the case's float32 model (seeded), and the
    K-FAC factors of its float64 twin (themselves checked against their definitions in
    ``test_kfac.py``), computed once per case."""
    if case.id in _REFERENCES:
        return _REFERENCES[case.id]
    model, inputs, target, ref = _setup(case)
    twin, twin_inputs = _float64_twin(model, inputs)
    with gradhooks.add_hooks(twin, loss_reduction="sum", quantities=("kfac",)) as h:
        args = twin_inputs if isinstance(twin_inputs, tuple) else (twin_inputs,)
        _loss(case, twin(*args), target).backward()
        factors = h.kfac_factors()
    _REFERENCES[case.id] = ref, factors
    return ref, factors


@pytest.mark.parametrize("quantities", [("grad1",), ("norms", "sum_grad_sq", "kfac")],
                         ids=["grad1", "norms-sq-kfac"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_quantities(case, dtype, quantities):
    """Every quantity of one backward under autocast, in float32 (grad1 in the parameter's
    dtype), within the precision's tolerance of the float64 loop. The norms without grad1 take
    the calls' detached paths (their batch gradient from the pieces)."""
    if not _runs(case, dtype):
        pytest.skip(f"torch has no {dtype} kernel for this layer on this CPU")
    ref, factors = _reference(case)
    tols = _tolerances(case, dtype)  # (first: a case may build its model once)
    model, inputs, target, _ = _setup(case, loop=False)
    h = hooked(case, model, inputs, target, dtype, quantities)
    for name, p in model.named_parameters():
        # .grad: as autograd computes it, or from the pieces for a detached call
        _assert_batch_grad(p.grad, ref[name], tols[name], f"{case.id} .grad of {name}")
    if "grad1" in quantities:
        for name, p in model.named_parameters():
            assert p.grad1.dtype == p.dtype == torch.float32, name
            _assert_rel(p.grad1, ref[name], tols[name], f"{case.id} {name}")
        return
    norms = h.param_norms()
    total = sum(r.flatten(1).pow(2).sum(1) for r in ref.values()).sqrt()
    sq, var = h.sum_grad_sq(), h.grad_variance()
    for name, r in ref.items():
        assert norms[name].dtype == sq[name].dtype == var[name].dtype == torch.float32, name
        tol = tols[name]
        _assert_rel(norms[name], r.flatten(1).norm(dim=1), tol, f"{case.id} norm of {name}")
        # a square doubles the relative error; the variance, a difference, more
        _assert_rel(sq[name], r.pow(2).sum(0), 2 * tol, f"{case.id} sum_grad_sq {name}")
        _assert_rel(var[name], r.var(0, unbiased=False), 4 * tol, f"{case.id} variance {name}")
    tol = max(tols.values())
    _assert_rel(h.norms(), total, tol, f"{case.id} total norm")
    got = h.kfac_factors()
    assert got.keys() == factors.keys() and got
    for name, f in factors.items():
        assert got[name].A.dtype == got[name].G.dtype == torch.float32, name
        _assert_rel(got[name].A, f.A, 2 * tol, f"{case.id} A of {name}")
        _assert_rel(got[name].G, f.G, 2 * tol, f"{case.id} G of {name}")


def _float64_twin(model: nn.Module, inputs):
    return copy.deepcopy(model).double(), _double(inputs)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("case", CASES)
def test_jacobians(case, dtype):
    """``gradhooks.jacobians`` under autocast against the float64 loop, one output at a time."""
    if not _runs(case, dtype):
        pytest.skip(f"torch has no {dtype} kernel for this layer on this CPU")
    torch.manual_seed(0)
    model, inputs = _float32(case), case.inputs(BATCH)
    if isinstance(inputs, tuple):
        pytest.skip("jacobians() takes one input tensor")
    twin, twin_inputs = _float64_twin(model, inputs)
    with torch.autocast("cpu", dtype=dtype):
        got = gradhooks.jacobians(model, inputs)
    outputs = twin(twin_inputs).flatten(1).shape[1]
    columns = [
        loop_grad(twin, lambda out, c=c: out.flatten(1)[:, c].sum(), twin_inputs)
        for c in range(outputs)
    ]
    for name, g in got.items():
        assert g.dtype == torch.float32, name
        want = torch.stack([col[name] for col in columns], 1)
        _assert_rel(g, want, TOL[dtype], f"{case.id} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mlp", "conv_net", "lstm", "multihead_attention"])
def test_kfac_function(case, dtype):
    """``gradhooks.kfac`` (its backwards under vmap) under autocast against its float64 twin."""
    case = next(c for cases in CASES_BY_LAYER.values() for c in cases if c.id == case)
    if not _runs(case, dtype):
        pytest.skip(f"torch has no {dtype} kernel for this layer on this CPU")
    torch.manual_seed(0)
    model, inputs = _float32(case), case.inputs(BATCH)
    twin, twin_inputs = _float64_twin(model, inputs)
    want = gradhooks.kfac(twin, twin_inputs, fisher="exact")
    with torch.autocast("cpu", dtype=dtype):
        got = gradhooks.kfac(model, inputs, fisher="exact")
    assert got.keys() == want.keys() and got
    for name, f in want.items():
        _assert_rel(got[name].A, f.A, 2 * TOL[dtype], f"{case.id} A of {name}")
        _assert_rel(got[name].G, f.G, 2 * TOL[dtype], f"{case.id} G of {name}")


def _check_grad1_and_norms(case: Case, model, ref: dict, tol: float | dict[str, float]) -> None:
    for name, p in model.named_parameters():
        assert p.grad1.dtype == p.dtype, name
        t = tol[name] if isinstance(tol, dict) else tol
        _assert_rel(p.grad1, ref[name], t, f"{case.id} {name}")


@pytest.mark.parametrize("with_autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("case", SOME)
def test_bfloat16_parameters(case, with_autocast):
    """``model.to(torch.bfloat16)``: grad1 in bfloat16 (as ``.grad``), its products'
    accumulation in float32 inside the kernels; norms, squared sums and K-FAC factors in
    float32. The reference is the float64 loop of the bfloat16 parameters themselves."""
    case = _case(case)
    model, inputs, target, _ = _setup(case, loop=False)
    model = model.to(BF16)
    low = lambda t: t.to(BF16) if t.is_floating_point() else t  # noqa: E731
    inputs = tuple(map(low, inputs)) if isinstance(inputs, tuple) else low(inputs)
    twin = copy.deepcopy(model).double()
    ref = loop_grad(twin, case.loss, _double(inputs), target)
    quantities = ("grad1", "norms", "sum_grad_sq", "kfac")
    h = hooked(case, model, inputs, target, BF16 if with_autocast else None, quantities)
    _check_grad1_and_norms(case, model, ref, TOL[BF16])
    norms, sq = h.param_norms(), h.sum_grad_sq()
    for name, r in ref.items():
        assert norms[name].dtype == sq[name].dtype == torch.float32, name
        _assert_rel(norms[name], r.flatten(1).norm(dim=1), TOL[BF16], f"{case.id} norm {name}")
        _assert_rel(sq[name], r.pow(2).sum(0), 2 * TOL[BF16], f"{case.id} sum_grad_sq {name}")
    for name, f in h.kfac_factors().items():
        assert f.A.dtype == f.G.dtype == torch.float32, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SOME)
def test_backward_inside_autocast(case, dtype):
    """The backward run inside the autocast block: the hooks' own products are not cast down."""
    case = _case(case)
    if not _runs(case, dtype):
        pytest.skip(f"torch has no {dtype} kernel for this layer on this CPU")
    ref, _ = _reference(case)
    tols = _tolerances(case, dtype)  # (first: a case may build its model once)
    model, inputs, target, _ = _setup(case, loop=False)
    h = hooked(case, model, inputs, target, dtype, ("grad1", "norms"), backward_inside=True)
    _check_grad1_and_norms(case, model, ref, tols)
    for name, n in h.param_norms().items():
        assert n.dtype == torch.float32, name
        _assert_rel(n, ref[name].flatten(1).norm(dim=1), tols[name], f"{case.id} norm {name}")


@pytest.mark.parametrize("quantities", [("grad1",), ("norms",)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mlp", "conv_net", "linear_seq_gram", "reused_linear_seq"])
def test_batch_gradient_from_pieces(case, dtype, quantities, monkeypatch):
    """``TUNING.sum_grad1_positions = 1``: every CPU Linear and convolution call runs with its
    parameters detached and takes ``.grad`` from its pieces (grad1's batch sum, or the pieces'
    own for the norms), under autocast too."""
    monkeypatch.setattr(gradhooks.TUNING, "sum_grad1_positions", 1)
    case = _case(case)
    ref, _ = _reference(case)
    tols = _tolerances(case, dtype)  # (first: a case may build its model once)
    model, inputs, target, _ = _setup(case, loop=False)
    h = hooked(case, model, inputs, target, dtype, quantities)
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name
        _assert_batch_grad(p.grad, ref[name], tols[name], f"{case.id} .grad of {name}")
    if "grad1" in quantities:
        _check_grad1_and_norms(case, model, ref, tols)
    else:
        for name, n in h.param_norms().items():
            _assert_rel(n, ref[name].flatten(1).norm(dim=1), tols[name], f"{case.id} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FALLBACK_CASES, ids=repr)
def test_fallback(case, dtype):
    """Layers without a rule (only the Linear rule registered): the torch.func fallback."""
    torch.manual_seed(0)
    model, inputs, target, ref = _setup(case)
    h = hooked(case, model, inputs, target, dtype, ("grad1",), registry=_only(nn.Linear))
    assert h.fallback_modules()
    _check_grad1_and_norms(case, model, ref, TOL[dtype])


class DtypeBranchingConv(nn.Conv2d):
    """A convolution whose weight is standardized with an ``eps`` its input's dtype chooses
    (denoising-diffusion-pytorch 1.x's ``WeightStandardizedConv2d``): a layer without a rule
    whose output from a bfloat16 input is not its output from that input in float32."""

    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        return torch.nn.functional.conv2d(x, (w - mean) * (var + eps).rsqrt(), self.bias,
                                          self.stride, self.padding)  # fmt: skip


def test_fallback_recomputes_from_the_inputs_as_the_forward_gave_them():
    """Under bfloat16 autocast the convolution before gives the layer a bfloat16 input: its
    fallback recomputes it from that input, under the same autocast, and matches the loop run
    under it. (It once recomputed it from the input cast to the parameters' float32, with
    ``eps=1e-5``: the output differed from the forward's by 0.75 and the call was refused as
    mixing the examples.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), DtypeBranchingConv(4, 4, 3, padding=1))
    x = torch.randn(3, 2, 6, 6)

    def loss(out):
        return out.float().pow(2).sum()

    with torch.autocast("cpu", dtype=BF16):
        want = loop_grad(model, loss, x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        assert out.dtype == BF16
        loss(out).backward()
    assert [name for name, _ in h.fallback_modules()] == ["1"]
    for name, p in model.named_parameters():
        _assert_rel(p.grad1, want[name], TOL[BF16], name)
        _assert_rel(p.grad1.sum(0), p.grad, TOL[BF16], name)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("layer", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer],
                         ids=["encoder", "decoder"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_transformer_layer_parts_rounded_as_they_ran(dtype, layer, batch_first, norm_first):
    """The Transformer layers' rule reruns the layer to find its parts' output-gradients: under
    the forward's autocast, so that they are autograd's own. Rerun in float32 they differed from
    autograd's by the half precision's rounding upstream (up to 23 of its units of the largest
    entry, seen on these layers), grad1 did not add up to ``.grad`` and the run-time check
    raised in an ordinary autocast step. Now they add up to within the last products'
    rounding."""
    if not _runs(_case("transformer_encoder_layer"), dtype):
        pytest.skip(f"torch has no {dtype} kernel for this layer on this CPU")
    eps = torch.finfo(dtype).eps
    for seed in range(3):
        torch.manual_seed(seed)
        module = layer(8, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        x = torch.randn(4, 5, 8) if batch_first else torch.randn(5, 4, 8)
        args = (x,) if layer is nn.TransformerEncoderLayer else (x, torch.randn_like(x))
        with gradhooks.add_hooks(module, loss_reduction="sum"):  # (checked: would raise)
            with torch.autocast("cpu", dtype=dtype):
                out = module(*args)
            (out.float() * torch.linspace(-1, 2, 8)).sum().backward()
        for name, p in module.named_parameters():
            diff = float((p.grad1.sum(0).double() - p.grad.double()).abs().max())
            scale = float(p.grad1.abs().max())
            assert diff <= 4 * eps * scale, f"seed {seed} {name}: {diff / scale / eps:.1f} units"


# -- real models: tiny Hugging Face configurations (tests/test_real_models.py) ------------------
# T5's relative-attention bias is computed once for the batch; its per-example shares come
# through bfloat16 attention. Left out: Qwen2-MoE (under bfloat16 its router picks other
# experts for some tokens than in float64: no reference to compare with).
HF_MODELS = ["gpt2", "bert-classifier", "llama", "funnel", "t5"]


@pytest.mark.parametrize("name", HF_MODELS)
def test_hugging_face_bfloat16_autocast(name):
    """grad1 of every parameter of a tiny GPT-2, BERT, Llama and Funnel (its relative
    attention through the fallback), run under CPU bfloat16 autocast, against the float64
    loop. A parameter whose gradient is zero by symmetry (a
    key's bias: the softmax ignores a shift) holds rounding noise: errors are relative to
    the larger of its own largest entry and 1% of the model's."""
    pytest.importorskip("transformers")
    import test_real_models as real

    factory, loss_fn, kw, _ = real.HF[name]
    torch.manual_seed(0)
    model = factory().eval()
    batch = real.text(3, 5, **kw)
    ref = real.loop_oracle(copy.deepcopy(model).double(), batch, loss_fn, 3)
    overall = max(float(r.abs().max()) for r in ref.values())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=BF16):
            loss = loss_fn(model, batch)
        loss.float().backward()
    for n, p in model.named_parameters():
        if p.grad is None:  # (Funnel's key biases: no gradient reaches them at all)
            assert not hasattr(p, "grad1") and (n not in ref or not ref[n].any()), n
            continue
        assert p.grad1.dtype == torch.float32, n
        diff = float((p.grad1.double() - ref[n]).abs().max())
        scale = max(float(ref[n].abs().max()), 1e-2 * overall)
        assert diff <= TOL[BF16] * scale, f"{name} {n}: relative error {diff / scale:.2e}"


def test_precision_bench_measures_against_the_loop():
    """``python -m bench.precision``'s measurement, on its MLP: float32 to float32's rounding,
    bfloat16 autocast to bfloat16's, grad1 in the parameters' dtype (asserted inside)."""
    from bench import precision

    gen = torch.Generator().manual_seed(0)
    make, x, y = precision._models(4, gen)["MLP"]
    exact, _ = precision.measure(make, x, y, torch.float32, None, seed=0)
    low, autograd = precision.measure(make, x, y, torch.float32, BF16, seed=0)
    assert exact < 1e-5 and 1e-5 < low < TOL[BF16] and autograd < TOL[BF16]


class _NormedConv(nn.Module):
    """A Linear, then a weight-normed grouped convolution over the sequence (Wav2Vec2's
    positional convolution): the convolution's weight, computed from the parametrization's
    parameters, meets the batch in ``conv1d``, which the tracker runs again at the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        conv = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.conv = nn.utils.parametrizations.weight_norm(conv, dim=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.proj(x).transpose(1, 2))


def test_operation_run_again_at_the_backward_under_its_forwards_autocast():
    """Under autocast the convolution ran on the Linear's bfloat16 output with float32
    parameters, autocast casting them to bfloat16; run again at the backward without autocast,
    it refused the mixed dtypes (``Input type (c10::BFloat16) and bias type (float)``, a
    crash of Hugging Face's Wav2Vec2 and HuBERT). Now it runs under the forward's autocast."""
    torch.manual_seed(0)
    model = _NormedConv()
    x = torch.randn(BATCH, 8, 4)
    ref = loop_grad(copy.deepcopy(model).double(), lambda out: out.square().sum(), x.double())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        out.float().square().sum().backward()
    for n, p in model.named_parameters():
        assert rel_err(p.grad1, ref[n]) <= TOL[BF16], n


def _batched_as_per_example(model: nn.Module, x: Tensor, name: str) -> bool:
    """Whether module ``name`` of ``model`` gives the batch under bfloat16 autocast what it
    gives each example alone (within a tenth of its largest entry)."""
    module = model.get_submodule(name)
    seen: list[Tensor] = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            model(x)
            for b in range(x.shape[0]):
                model(x[b : b + 1])
    finally:
        handle.remove()
    batched, alone = seen[0], torch.cat(seen[1:])
    return float((batched - alone).abs().max()) <= 0.1 * float(alone.abs().max())


def test_segformer_stage_reduced_to_one_token_under_bfloat16_autocast():
    """A Segformer stage whose sequence reduction leaves keys and values one token long. Its
    reduction convolution reads a channels-last view (``transpose(1, 2).reshape(...)``), on
    which torch's CPU bfloat16 convolution gives the batch other numbers than each example
    alone on some machines (an error of the size of the output itself): the model's batched
    forward is then not its per-example one, and no per-example gradient of it is the loop's
    (``grad1`` still sums to ``.grad``). On a contiguous input both agree, and so do
    ``grad1`` and the loop."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=1, depths=[1], sr_ratios=[8], hidden_sizes=[8],
        patch_sizes=[7], strides=[4], num_attention_heads=[1], mlp_ratios=[4],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SegformerModel(config).train()
    x = torch.randn(BATCH, 3, 32, 32)  # 8 x 8 patches, reduced by 8: keys of one token
    r = torch.randn(8, 1, 1)

    def loss(out):
        return (out.last_hidden_state.float().sin() * r.to(out.last_hidden_state)).sum()

    ref = loop_grad(copy.deepcopy(model).double(), loss, x.double())
    with torch.autocast("cpu", dtype=BF16):
        rounded = loop_grad(model, loss, x)  # the model's own bfloat16 rounding, per example
    largest = max(float(g.abs().max()) for g in ref.values())
    reduction = "stages.0.blocks.0.attention.sequence_reduction.sequence_reduction"
    if not _batched_as_per_example(model, x, reduction):
        pytest.skip(
            "torch's CPU bfloat16 convolution of the channels-last view the sequence "
            "reduction reads gives the batch other numbers than each example alone on this "
            "machine: the loop is not the batched model's per-example reference"
        )
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        loss(out).backward()
    for n, p in model.named_parameters():
        scale = max(float(ref[n].abs().max()), 1e-2 * largest)
        own = rel_err(rounded[n], ref[n], scale)
        assert rel_err(p.grad1, ref[n], scale) <= TOL[BF16] + 2 * own, n


class _MaskedAttention(nn.Module):
    """A Linear, then self-attention with a causal mask made in the activations' dtype (under
    bfloat16 autocast: a bfloat16 mask, which torch's forward takes); ``layer``: the attention
    alone, or inside a TransformerEncoderLayer (its rule hands the call to the attention's)."""

    def __init__(self, layer: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if layer == "attention":
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        else:
            self.attn = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True)

    def forward(self, x):
        h = self.lin(x)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], dtype=h.dtype)
        if isinstance(self.attn, nn.MultiheadAttention):
            return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.attn(h, src_mask=mask)


@pytest.mark.parametrize("layer", ["attention", "encoder_layer"])
def test_attention_mask_in_bfloat16_under_autocast(layer):
    """A float attention mask in bfloat16 (made in the dtype of activations computed under
    autocast) was handed as is to the attention rule's float32 recomputation, which
    ``scaled_dot_product_attention`` refused (RuleError: "Expected attn_mask dtype to be bool
    or float or to match query dtype"). Now it is cast to the recomputation's dtype (its
    values, -inf and 0, unchanged); grad1 within 16 units of bfloat16's eps of the float64
    loop's largest entry."""
    torch.manual_seed(0)  # (the layers' uniform initialization)
    model = _MaskedAttention(layer)
    x = torch.linspace(-2, 2, BATCH * 5 * 4).sin().reshape(BATCH, 5, 4)
    ref = loop_grad(copy.deepcopy(model).double(), lambda out: out.pow(2).sum(), x.double())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        out.float().pow(2).sum().backward()
    largest = max(float(g.abs().max()) for g in ref.values())
    eps = torch.finfo(BF16).eps
    for n, p in model.named_parameters():
        err = float((p.grad1.double() - ref[n]).abs().max())
        assert err <= 16 * eps * largest, f"{n}: {err:.2e} > 16 eps · {largest:.2e}"


def _formula_gru(freq: float, bias: float, steps: int, phase: int) -> tuple[nn.GRU, Tensor]:
    """A bidirectional 2-layer GRU of hidden size 1 and a batch of 2 sequences, its parameters
    and inputs from sines and cosines (the same numbers on every CPU: no random draws)."""
    gru = nn.GRU(2, 1, num_layers=2, bidirectional=True, batch_first=True)
    with torch.no_grad():
        for j, (n, p) in enumerate(gru.named_parameters()):
            k = torch.arange(p.numel(), dtype=torch.float64)
            p.copy_(((bias if "bias" in n else 1.0) * torch.sin(k * freq + j)).view(p.shape))
    x = torch.cos(torch.arange(4 * steps, dtype=torch.float64) * 0.9 + phase).view(2, steps, 2)
    return gru, x


@pytest.mark.parametrize(
    "freq, bias, steps, phase", [(2.9, 2.0, 4, 4), (4.7, 1.0, 6, 10)], ids=["large-biases", "plain"]
)
def test_recurrent_weights_rounded_as_their_terms_under_bfloat16_autocast(freq, bias, steps, phase):
    """A bidirectional 2-layer GRU of hidden size 1 under bfloat16 autocast: torch's own
    backward rounds each step's share of a weight's gradient, and takes the states it
    multiplies as the forward rounded them, relative to the gate pre-activations they come
    from, not to their values (small states: up to 24 units of bfloat16's eps of the gradient's
    own largest entry). The run-time check compared within 8 units of that entry and refused
    correct grad1 (CheckFailedError on ``weight_hh_l1``, ``bias_*_reverse``, ...); it compares
    relative to the magnitudes of the terms now (``Piece.terms_scale``, the states' rounding
    of the order of 1). grad1 within 16 units of eps of the float64 loop's largest entry (it
    is within 0.3; torch's own loop under autocast within 1.6); ``Hooks.check`` passes too."""
    gru, x = _formula_gru(freq, bias, steps, phase)

    def loss(out):
        return (out[0].float() ** 2).sum()

    ref = loop_grad(copy.deepcopy(gru).double(), loss, x)
    gru = gru.float()
    with gradhooks.add_hooks(gru, loss_reduction="sum") as h:
        with torch.autocast("cpu", dtype=BF16):
            out = gru(x.float())
        loss(out).backward()
        report = h.check(raise_on_error=False)
    assert not report.problems, str(report)
    largest = max(float(g.abs().max()) for g in ref.values())
    for n, p in gru.named_parameters():
        err = float((p.grad1.double() - ref[n]).abs().max())
        assert err <= 16 * torch.finfo(BF16).eps * largest, n


def test_check_allows_the_rounding_of_a_gradient_whose_terms_cancel_under_autocast():
    """``Hooks.check`` compared each parameter's ``grad1`` with ``.grad`` within 8 units of
    bfloat16's eps of that parameter's own largest entry, with none of the room the run-time
    check gives (the rounding of its terms, a share of the model's largest gradient entry):
    on the GRU above with large biases (hooked without the run-time check), it reported ``grad1.sum(0)
    differs from .grad`` for gradients that were right. A term of the loss that no example
    owns (a penalty on a parameter) is still reported."""
    gru, x = _formula_gru(2.9, 2.0, 4, 4)
    gru = gru.float()
    with gradhooks.add_hooks(gru, loss_reduction="sum", verify=False) as h:
        with torch.autocast("cpu", dtype=BF16):
            out = gru(x.float())
        (out[0].float() ** 2).sum().backward()
        h.check()
        gru.zero_grad()
        h.clear()
        with torch.autocast("cpu", dtype=BF16):
            out = gru(x.float())
        penalty = gru.bias_ih_l0.sum()  # (no example's: .grad holds more than grad1)
        ((out[0].float() ** 2).sum() + penalty).backward()
        report = h.check(raise_on_error=False)
    assert any("'bias_ih_l0'" in problem for problem in report.problems), str(report)


def test_cast_cache_keeps_the_first_version_within_one_autocast_block():
    """:class:`gradhooks.autocast.CastCache`: within one autocast block (nested blocks
    included) a float32 leaf that requires grad keeps the version of its first sighting after
    it is changed in place, as autocast's cache keeps its cast; a new block starts afresh;
    tensors autocast does not cache (float64, frozen, not a leaf) keep their version now."""
    from gradhooks.autocast import CastCache, autocast_state

    cache = CastCache()
    w = nn.Parameter(torch.randn(3, 3))
    wide = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    frozen = torch.randn(3, 3)
    tensors = {"w": w, "wide": wide, "frozen": frozen, "made": w * 2}
    with torch.autocast("cpu", dtype=BF16):
        state = autocast_state()
        first = cache.versions(tensors, state)
        cast = torch.nn.functional.linear(torch.eye(3), w)  # (autocast caches w's cast)
        with torch.no_grad():
            for t in (w, wide, frozen):
                t.mul_(0.5)
        with torch.autocast("cpu", dtype=BF16):  # (nested: the same cache)
            again = cache.versions(tensors, state)
        assert again["w"] == first["w"] != w._version
        for n in ("wide", "frozen"):
            assert again[n] == tensors[n]._version != first[n], n
        assert again["made"] == tensors["made"]._version
        # (torch's own forward in the block runs with the first cast)
        assert torch.equal(torch.nn.functional.linear(torch.eye(3), w), cast)
    with torch.autocast("cpu", dtype=BF16):
        assert cache.versions(tensors, autocast_state())["w"] == w._version


class _Triplet(nn.Module):
    """One network called on anchors, positives and negatives, a triplet loss of the three:
    its last bias cancels in every distance, so its gradient is zero and each call's share of
    it, rounded by autograd in the half precision, is all that is left."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, a, p, n):
        ea, ep, en = self.net(a), self.net(p), self.net(n)
        return torch.relu((ea - ep).pow(2).sum(1) - (ea - en).pow(2).sum(1) + 1.0)


@pytest.mark.parametrize("how", ["grad1", "dp-grad1", "dp-bookkeeping"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_shares_of_several_calls_that_cancel(dtype, how):
    """A layer called three times whose shares of a gradient cancel (the triplet network's
    last bias): the run-time checks (the sum over the batch, the probe, the DP step's own)
    allow for each call's share rounded apart, so the backward and the step are not refused,
    and ``grad1`` is the float64 loop's within the format's tolerance (relative to the
    model's largest entry there); ``check()`` after it finds nothing either."""
    torch.manual_seed(0)
    model = _Triplet()
    args = tuple(torch.randn(4, 6) for _ in range(3))
    ref = loop_grad(copy.deepcopy(model).double(), lambda out: out.sum(), _double(args))
    top = max(float(r.abs().max()) for r in ref.values())
    quantities = ("norms",) if how == "dp-bookkeeping" else ("grad1",)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=quantities) as hooks:
        with torch.autocast("cpu", dtype=dtype):
            losses = model(*args).float()
        if how == "grad1":
            losses.sum().backward()
            for name, p in model.named_parameters():
                assert rel_err(p.grad1, ref[name], top) < TOL[dtype], name
            assert hooks.check(raise_on_error=False).problems == []
        else:
            method = how.split("-")[1]
            gradhooks.dp_sgd_step(hooks, losses, max_norm=1e6, noise_multiplier=0.0,
                                  reduction="sum", method=method)  # fmt: skip
            for name, p in model.named_parameters():
                assert rel_err(p.grad, ref[name].sum(0), top) < TOL[dtype], name

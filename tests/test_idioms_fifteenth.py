"""Training-loop idioms, a fifteenth set: what the batch and the model look like, in memory and
in form.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a form the earlier sets do not train: a CNN converted to ``channels_last`` (Conv2d,
BatchNorm in eval, GroupNorm, ConvTranspose2d) fed ``uint8`` channels_last images cast in the
forward, by SGD and through the DP step, and volumes in ``channels_last_3d``; a batch given as
a tensor subclass (torchvision's ``tv_tensors``); a ``torch.fx`` GraphModule, as traced and
after a pass that rewrites its Linear calls into ``F.linear`` on the weights it fetches, and one
whose convolution and batch norm an fx pass fused; ``fuse_conv_bn_eval`` applied between steps;
``parametrize`` with ``unsafe=True`` (a flat original reshaped, a low-rank pair); a frozen
TorchScript backbone (scripted or traced) under a trained head, and a scripted function between
layers; a batch given as a Mapping that is not a dict, and as a nested dict with metadata that
is not tensors; an ``nn.ModuleDict`` routed by the batch's modality; bucketed batches padded to
another length at each step, through the DP step; a batch in which one example appears twice
(indexed, concatenated, or rows that overlap in memory); a time-major dict batch
(``batch_dim=1``) with its lengths first. And misuse: a batch sliced from the model's own
weight, a list of inputs of different batch sizes, the next batch loaded into the other half of
a static buffer between the forward and its backward, ``load_state_dict(..., assign=True)``
between the forward and its backward, and a nested batch whose first tensor is metadata. Each
is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`, or a loop written out where the batch is not a tensor), or
with the DP step's clipped sum of those, or checked to stop with a typed error that names what
went wrong."""

from __future__ import annotations

import collections.abc
import copy
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1
from harness import labelled_batch as batch
from harness import wide_mlp as mlp

# (torch 2.13 deprecates TorchScript, which the tests of a model holding it run)
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.* is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]

D = torch.float64
STEPS = 3


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def step_against_the_loop(model, hooks, opt, x, y, where: str, given=None, **check) -> None:
    """One SGD step of a cross-entropy of ``model(given)`` (``given``: ``x`` unless another form
    of it): ``grad1`` and the norms against the float64 loop over ``x``, then the step."""
    want = loop_grad(model, F.cross_entropy, x, y)
    opt.zero_grad()
    F.cross_entropy(model(x if given is None else given), y).backward()
    assert_grad1(model, want, where, **check)
    assert_close(hooks.norms(), norms_of(want), f"{where}: norms")
    opt.step()


def clipped_sum(want: dict, name: str, max_norm: float) -> torch.Tensor:
    """The sum over the examples of parameter ``name``'s rows of ``want``, each example's
    gradient clipped to ``max_norm`` over all parameters (the DP step's sum before the noise)."""
    factors = (max_norm / norms_of(want)).clamp(max=1.0)
    return torch.einsum("b,b...->...", factors, want[name])


def loop_over(model: nn.Module, examples: list, y: torch.Tensor) -> dict:
    """Each example's gradient of its cross-entropy, one forward and backward per example, for
    batches that are not tensors (``examples[i]``: what the model takes for example ``i``);
    parameters an example does not reach get a zero row."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = {n: [] for n in params}
    for i, example in enumerate(examples):
        loss = F.cross_entropy(model(example), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(r) for n, r in rows.items()}


# -- memory layouts --------------------------------------------------------------------------------


class ChannelsLastNet(nn.Module):
    """Conv2d, BatchNorm2d (in eval: its running statistics, not the batch's), GroupNorm and a
    ConvTranspose2d upsampling, on ``uint8`` images cast and scaled inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.gn = (
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.GroupNorm(2, 4),
        )
        self.up, self.head = nn.ConvTranspose2d(4, 2, 2, stride=2), nn.Linear(2, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.conv.weight.dtype).div(255)
        h = self.up(torch.relu(self.gn(self.bn(self.conv(x)))))
        return self.head(h.mean((2, 3)))

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn.eval()  # (frozen statistics, as in fine-tuning a detector's backbone)
        return self


def images(step: int, n: int = 4):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (n, 3, 4, 4), generator=g, dtype=torch.uint8)
    return x.contiguous(memory_format=torch.channels_last), torch.randint(3, (n,), generator=g)


def test_a_channels_last_cnn_fed_uint8_channels_last_images_cast_in_the_forward():
    """The recipe of torch's memory-format tutorial (pytorch/tutorials,
    ``intermediate_source/memory_format_tutorial.py``: ``model.to(memory_format=
    torch.channels_last)`` and every batch ``.contiguous(memory_format=torch.channels_last)``),
    on a net of Conv2d, BatchNorm2d in eval, GroupNorm and ConvTranspose2d, its ``uint8`` images
    cast to the weights' dtype and scaled in the forward. Over SGD steps grad1 and the norms are
    the float64 loop's; the weights stay channels_last."""
    model = ChannelsLastNet().to(D).to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = images(step)
            step_against_the_loop(model, hooks, opt, x, y, f"step {step}")
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("method", ["grad1", "ghost"])
def test_a_channels_last_cnn_in_the_dp_step(method):
    """The same net and batches through ``dp_sgd_step`` (no noise): the norms and ``.grad``
    are the loop's, clipped, at each of two steps."""
    model = ChannelsLastNet().to(D).to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        for step in range(2):
            x, y = images(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            norms = gradhooks.dp_sgd_step(
                hooks, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.1,
                noise_multiplier=0.0, method=method,
            )  # fmt: skip
            assert_close(norms, norms_of(want), f"step {step}: norms")
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped_sum(want, n, 0.1) / len(x), f"step {step}: {n}")
            opt.step()


def test_a_channels_last_3d_volume_net():
    """Volumes in ``channels_last_3d`` (Conv3d, GroupNorm, ConvTranspose3d, the model and
    the batches converted): grad1 and the norms are the loop's over SGD steps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(2, 3, 2), nn.GroupNorm(1, 3), nn.ConvTranspose3d(3, 2, 2), nn.Flatten(),
        nn.Linear(54, 2),
    ).to(D).to(memory_format=torch.channels_last_3d)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(6)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(2):
            x = torch.randn(4, 2, 3, 3, 3, generator=g, dtype=D)
            x, y = (
                x.contiguous(memory_format=torch.channels_last_3d),
                torch.randint(2, (4,), generator=g),
            )
            step_against_the_loop(model, hooks, opt, x, y, f"step {step}")


class Image(torch.Tensor):
    """A tensor subclass as torchvision's ``tv_tensors.Image`` (pytorch/vision,
    ``torchvision/tv_tensors/_tv_tensor.py``): a torch function on it returns a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if isinstance(out, cls) else out


def test_a_batch_given_as_a_tensor_subclass():
    """A batch of images given as that subclass (``x.as_subclass(Image)``, what a v2
    transforms pipeline hands the model): grad1 and the norms are those of the plain
    tensor's, by the loop, over SGD steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(2):
            x, y = (
                torch.randn(5, 3, 4, 4, generator=g, dtype=D),
                torch.randint(2, (5,), generator=g),
            )
            step_against_the_loop(
                model, hooks, opt, x, y, f"step {step}", given=x.as_subclass(Image)
            )


def test_a_batch_with_one_example_twice():
    """A sampler with replacement gives one example twice: rows picked by an index with a
    repeat (``x[[0, 1, 1, 2, 3]]``), the first example concatenated again, and rows that
    overlap in memory (``as_strided`` with a row stride smaller than a row). Each row of grad1
    is its own example's gradient, so the repeated rows are equal, not shared or doubled."""
    base, labels = batch(0, n=5)
    picks = {  # the batch, its labels, the two rows that hold one example
        "index": (base[[0, 1, 1, 2, 3]], labels[[0, 1, 1, 2, 3]], (1, 2)),
        "cat": (torch.cat([base[:4], base[:1]]), torch.cat([labels[:4], labels[:1]]), (0, 4)),
        "overlapping": (base.flatten()[:12].as_strided((5, 3), (2, 1)), labels, None),
    }
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for what, (x, y, twice) in picks.items():
            want = loop_grad(model, F.cross_entropy, x.contiguous(), y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, what)
            assert_close(hooks.norms(), norms_of(want), f"{what}: norms")
            if twice is not None:
                i, j = twice
                assert torch.equal(model[0].weight.grad1[i], model[0].weight.grad1[j]), what
            opt.step()


# -- model forms -----------------------------------------------------------------------------------


def _functional_linears(gm: fx.GraphModule) -> fx.GraphModule:
    """An fx pass: every call of a Linear module becomes ``F.linear`` on its weight and bias
    fetched by ``get_attr`` (the module is then never called)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
            with gm.graph.inserting_before(node):
                w = gm.graph.get_attr(f"{node.target}.weight")
                b = gm.graph.get_attr(f"{node.target}.bias")
                new = gm.graph.call_function(F.linear, (node.args[0], w, b))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


@pytest.mark.parametrize("form", ["traced", "linears rewritten"])
def test_a_graph_module_from_symbolic_trace_and_after_a_pass(form):
    """A model made by ``torch.fx.symbolic_trace`` (a GraphModule whose forward is generated
    code calling its submodules), as traced and after a pass that rewrites each Linear call
    into ``F.linear`` on ``get_attr`` nodes (the shape of fx's module-to-function rewrites;
    pytorch/tutorials, ``intermediate_source/fx_conv_bn_fuser.py``, for the pattern of a pass).
    grad1 is the loop's at every SGD step, also for the weights used outside their modules."""
    gm = fx.symbolic_trace(mlp())
    if form == "linears rewritten":
        gm = _functional_linears(gm)
        assert "linear" in gm.code and not any(n.op == "call_module" and "0" == n.target
                                               for n in gm.graph.nodes)  # fmt: skip
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    with gradhooks.add_hooks(gm, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            step_against_the_loop(gm, hooks, opt, x, y, f"{form}, step {step}")


def _conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)
    ).to(D)
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _images(step: int):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(5, 2, 6, 6, generator=g, dtype=D), torch.randint(2, (5,), generator=g)


def test_a_graph_module_whose_conv_and_batch_norm_an_fx_pass_fused_then_fine_tuned():
    """``torch.fx.experimental.optimization.fuse`` (pytorch/pytorch,
    ``torch/fx/experimental/optimization.py``: traces the model and replaces each Conv2d +
    BatchNorm2d pair by one Conv2d whose weight and bias fold the statistics in), then the
    fused GraphModule fine-tuned: grad1 of the fused convolution is the loop's, step by
    step."""
    from torch.fx.experimental.optimization import fuse

    fused = fuse(_conv_bn().eval()).train()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    with gradhooks.add_hooks(fused):
        for step in range(STEPS):
            x, y = _images(step)
            want = loop_grad(fused, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(fused(x), y).backward()
            assert_grad1(fused, want, f"step {step}")
            opt.step()


def test_fuse_conv_bn_eval_applied_between_steps():
    """Training with the batch norm in eval (frozen statistics), then, between two steps,
    ``torch.nn.utils.fusion.fuse_conv_bn_eval`` folds it into the convolution (pytorch/pytorch,
    ``torch/nn/utils/fusion.py``: a new Conv2d with new parameters), put in the convolution's
    place with an ``nn.Identity`` in the norm's, and the optimizer made again. grad1 is the
    loop's before and after, and the fused model's outputs are the unfused one's."""
    model = _conv_bn()
    model[1].eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                x, _ = _images(step)
                with torch.no_grad():
                    before = model(x)
                    model[0] = fuse_conv_bn_eval(model[0].eval(), model[1]).train()
                    model[1] = nn.Identity()
                    torch.testing.assert_close(model(x), before)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = _images(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class Unflatten(nn.Module):
    """The weight kept as a flat vector: ``right_inverse`` flattens it (changing its shape,
    which ``unsafe=True`` allows)."""

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(6, 3)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.reshape(-1)


class LowRank(nn.Module):
    """The weight as the product of two trained factors, ``[6, 2] @ [2, 3]``: ``right_inverse``
    returns the pair (two originals of shapes other than the weight's)."""

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return u @ v

    def right_inverse(self, weight: torch.Tensor):
        return weight[:, :2].clone(), torch.eye(2, 3, dtype=weight.dtype)


@pytest.mark.parametrize("par", [Unflatten, LowRank], ids=["flat", "low-rank"])
def test_a_parametrization_registered_with_unsafe_true(par):
    """``parametrize.register_parametrization(layer, "weight", p, unsafe=True)`` (pytorch/pytorch,
    ``torch/nn/utils/parametrize.py``: ``unsafe`` lets the originals take other shapes than
    the weight's): grad1 is on the originals, of their shapes, and is the loop's at every Adam
    step."""
    model = mlp()
    parametrize.register_parametrization(model[0], "weight", par(), unsafe=True)
    originals = [n for n, _ in model.named_parameters() if "original" in n]
    assert originals
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class Router(nn.Module):
    """An encoder per modality in an ``nn.ModuleDict``, picked by the batch's ``"modality"``
    (a string), a projection per modality, one shared head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoders = nn.ModuleDict(
            {"image": nn.Conv2d(1, 4, 3), "text": nn.EmbeddingBag(20, 4, mode="mean")}
        )
        self.projections = nn.ModuleDict({"image": nn.Linear(16, 4), "text": nn.Identity()})
        self.head = nn.Linear(4, 2)

    def forward(self, batch: dict) -> torch.Tensor:
        kind = batch["modality"]
        h = self.projections[kind](self.encoders[kind](batch["data"]).flatten(1))
        return self.head(torch.tanh(h))


def test_a_module_dict_routed_by_the_modality_of_each_batch():
    """Batches of one modality each, alternating (images, then token bags), routed through an
    ``nn.ModuleDict`` by a string in the batch: at each step grad1 is the loop's for the
    encoders the batch used and the head; the other modality's encoder, not reached, keeps
    no grad1 of its own step (its ``.grad`` is ``None`` after ``zero_grad``)."""
    model = Router().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    with gradhooks.add_hooks(model):
        for step in range(4):
            kind = ("image", "text")[step % 2]
            if kind == "image":
                data = torch.randn(4, 1, 4, 4, generator=g, dtype=D)
            else:
                data = torch.randint(20, (4, 5), generator=g)
            y = torch.randint(2, (4,), generator=g)
            examples = [{"modality": kind, "data": data[i : i + 1]} for i in range(4)]
            want = loop_over(model, examples, y)
            opt.zero_grad()
            F.cross_entropy(model({"modality": kind, "data": data}), y).backward()
            for n, p in model.named_parameters():
                if n.startswith(("encoders.", "projections.")) and kind not in n:
                    assert p.grad is None and not hasattr(p, "grad1"), f"step {step}: {n}"
                else:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
            opt.step()


# -- TorchScript inside the hooked model -----------------------------------------------------------


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_frozen_torchscript_backbone_under_a_trained_head(how):
    """A linear probe on a feature extractor that comes as TorchScript (``torch.jit.script``
    or ``torch.jit.trace``, as ``torch.jit.load`` gives it), frozen, under a trained head. The
    tracker cannot see inside TorchScript, so it checks that the backbone keeps the examples
    apart (each example alone gives its row) and follows the batch through it: grad1 and the
    norms are the loop's over Adam steps."""
    torch.manual_seed(0)
    x, _ = batch(0)
    backbone = nn.Sequential(nn.Linear(3, 6), nn.Tanh()).to(D)
    backbone = torch.jit.script(backbone) if how == "script" else torch.jit.trace(backbone, x)
    for p in backbone.parameters():  # (a ScriptModule has no requires_grad_)
        p.requires_grad_(False)
    model = nn.Sequential(backbone, nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            step_against_the_loop(model, hooks, opt, x, y, f"{how}, step {step}", frozen_clean=True)


class Centre(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


@pytest.mark.parametrize("mix", ["centre", "batch norm"])
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_frozen_torchscript_backbone_that_mixes_the_examples_is_refused_naming_it(how, mix):
    """The same frozen backbone ending in a centring over the batch, or in a BatchNorm in
    training mode: each example's features depend on the others', so the loop's gradients
    are not the batch's rows. Refused at the forward, naming the TorchScript module; nothing
    written; the norm's running statistics are those of one forward, as without gradhooks
    (the check's runs of one example leave them as they were)."""
    torch.manual_seed(0)
    x, _ = batch(0)
    last = Centre() if mix == "centre" else nn.BatchNorm1d(6)
    backbone = nn.Sequential(nn.Linear(3, 6), last).to(D)
    twin = copy.deepcopy(backbone)
    backbone = torch.jit.script(backbone) if how == "script" else torch.jit.trace(backbone, x)
    for p in backbone.parameters():  # (a ScriptModule has no requires_grad_)
        p.requires_grad_(False)
    model = nn.Sequential(backbone, nn.Linear(6, 2)).to(D)
    before = {n: b.clone() for n, b in backbone.named_buffers()}
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'1' \(Linear\).*TorchScript module '0'"
        ):
            model(x)
        assert not any(hasattr(p, "grad1") for p in model.parameters())
    twin.load_state_dict(before, strict=False)  # (tracing ran it, and checked it, too)
    twin(x)
    for (n, b), want in zip(backbone.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, want, rtol=0, atol=1e-12, msg=n)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Megatron-LM's fused bias + tanh-GELU (NVIDIA/Megatron-LM,
        ``megatron/core/fusions/fused_bias_gelu.py``, compiled by ``torch.jit.script``)."""
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BiasGeluMLP(nn.Module):
    """Megatron's MLP: the first projection without its bias (``skip_bias_add``), the bias
    added inside the scripted GELU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(3, 6, bias=False), nn.Linear(6, 2)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(bias_gelu(self.bias, self.fc1(x)))


def test_a_torchscript_function_between_layers_is_refused_saying_so():
    """A ``torch.jit.script`` function called between two layers: no torch function inside it
    reaches the tracker, so the layer after it seems to get an input without the examples.
    Refused with a typed error that names that layer and says that something it cannot see
    into (a TorchScript function) may have made its input; nothing is written."""
    model = BiasGeluMLP().to(D)
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'fc2' \(Linear\).*TorchScript"):
            F.cross_entropy(model(x), y).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Squared distances of ``x`` and ``y`` along their last dimension, broadcast, compiled
        as geoopt compiles its manifolds' distances."""
        return (x - y).pow(2).sum(-1)


class Prototypes(nn.Module):
    """Logits the negative distances to class prototypes held by the model itself, measured by
    a TorchScript function (a hyperbolic classifier's, with geoopt)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(3, 2)
        self.prototypes = nn.Parameter(torch.randn(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -squared_distances(self.encoder(x)[:, None], self.prototypes[None])


def test_a_parameter_met_by_the_batch_in_a_torchscript_function_is_refused_saying_so():
    """A parameter used outside any layer (indexed), then given to a TorchScript function
    with the batch: the tracker sees the parameter used but not the batch meeting it inside
    the function. Refused with a typed error that names the parameter and says that something
    it cannot see into (a TorchScript function) may be where they met; nothing is written."""
    model = Prototypes().to(D)
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match=r"'prototypes'.*TorchScript"):
            F.cross_entropy(model(x), y).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())


# -- batches in form -------------------------------------------------------------------------------


class TensorMapping(collections.abc.Mapping):
    """A TensorDict-like batch: a read-only Mapping of tensors (and of other mappings) with a
    ``batch_size``, not a dict."""

    def __init__(self, batch_size: int, **items) -> None:
        self._items, self.batch_size = items, torch.Size([batch_size])

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, batch) -> torch.Tensor:
        h = torch.tanh(self.body(batch["inputs"]["x"])) * batch["inputs"]["weight"]
        return self.head(h) / batch["meta"]["temperature"]


@pytest.mark.parametrize("form", ["mapping", "nested dict"])
def test_a_batch_as_a_mapping_or_a_nested_dict_with_metadata(form):
    """The batch given as a TensorDict-like Mapping (not a dict), or as a nested dict whose
    metadata holds strings, a list of ids as long as the batch, a step count and a
    temperature tensor: grad1 is the loop's over SGD steps."""
    model = DictModel().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def make(x, w, step):
        inputs = {"x": x, "weight": w}
        meta = {"ids": [f"ex{i}" for i in range(len(x))], "step": step, "split": "train",
                "temperature": torch.tensor(2.0, dtype=D)}  # fmt: skip
        if form == "mapping":
            return TensorMapping(len(x), inputs=TensorMapping(len(x), **inputs), meta=meta)
        return {"inputs": inputs, "meta": meta}

    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            w = torch.rand(len(x), 1, dtype=D, generator=torch.Generator().manual_seed(step))
            want = loop_over(model, [make(x[i : i + 1], w[i : i + 1], step) for i in range(5)], y)
            opt.zero_grad()
            F.cross_entropy(model(make(x, w, step)), y).backward()
            assert_grad1(model, want, f"{form}, step {step}")
            opt.step()


class Bag(nn.Module):
    """Token ids, 0 for padding: an embedding, a convolution along the sequence, a mean over
    the tokens that are not padding, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 4, padding_idx=0)
        self.conv, self.out = nn.Conv1d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = (tokens != 0).unsqueeze(-1).to(self.emb.weight.dtype)
        h = torch.tanh(self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2))
        return self.out((h * keep).sum(1) / keep.sum(1))


@pytest.mark.parametrize("method", ["grad1", "ghost"])
def test_bucketed_batches_padded_to_another_length_at_each_step(method):
    """Sequences bucketed by length and each bucket padded to its longest (torchtext's
    ``BucketIterator``, fairseq's batches by size): 3, 7 and 5 tokens at successive steps,
    each example shorter or as long. Through the DP step, the norms and ``.grad`` are the
    loop's over each example unpadded (the padding changes nothing), at every step."""
    model = Bag().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as hooks:
        for longest in (3, 7, 5):
            lengths = torch.randint(1, longest + 1, (4,), generator=g)
            lengths[0] = longest
            tokens = torch.randint(1, 30, (4, longest), generator=g)
            tokens = tokens * (torch.arange(longest) < lengths[:, None])
            y = torch.randint(2, (4,), generator=g)
            want = loop_over(model, [tokens[i : i + 1, : lengths[i]] for i in range(4)], y)
            opt.zero_grad()
            norms = gradhooks.dp_sgd_step(
                hooks, F.cross_entropy(model(tokens), y, reduction="none"), max_norm=0.5,
                noise_multiplier=0.0, method=method,
            )  # fmt: skip
            assert_close(norms, norms_of(want), f"length {longest}: norms")
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped_sum(want, n, 0.5) / 4, f"length {longest}: {n}")
            opt.step()


class TimeMajor(nn.Module):
    """Token ids ``[time, batch]`` through an embedding and a GRU (time-major, as torch's word
    language model), the output at each sequence's last token classified."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(20, 4), nn.GRU(4, 5), nn.Linear(5, 2)

    def forward(self, batch: dict) -> torch.Tensor:
        h, _ = self.rnn(self.emb(batch["tokens"]))
        return self.out(h[batch["lengths"] - 1, torch.arange(h.shape[1])])


@pytest.mark.parametrize("first", ["tokens", "lengths"])
def test_a_time_major_batch_dict_with_its_lengths_first_or_last(first):
    """``add_hooks(model, batch_dim=1)`` and a dict batch of ``[time, batch]`` tokens with the
    ``[batch]`` lengths (a torchtext-style batch), either first: the batch is the first tensor
    that has a dimension 1 (before, lengths first were refused as "no batch dimension 1",
    with the advice to add one). grad1 is the loop's over SGD steps."""
    model = TimeMajor().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    with gradhooks.add_hooks(model, batch_dim=1):
        for step in range(STEPS):
            tokens = torch.randint(20, (6, 4), generator=g)
            lengths, y = torch.randint(1, 7, (4,), generator=g), torch.randint(2, (4,), generator=g)

            def of(tokens, lengths):
                if first == "lengths":
                    return {"lengths": lengths, "tokens": tokens}
                return {"tokens": tokens, "lengths": lengths}

            want = loop_over(
                model, [of(tokens[:, i : i + 1], lengths[i : i + 1]) for i in range(4)], y
            )
            opt.zero_grad()
            F.cross_entropy(model(of(tokens, lengths)), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- misuse ----------------------------------------------------------------------------------------


def test_a_batch_sliced_from_the_models_own_weight_is_refused_naming_it():
    """``model(model[0].weight)``: the "examples" are rows of a trained weight, so each
    example's loss reaches that weight twice, through the layer and through its input, and
    the layer's per-example pieces see only the first. Refused at the backward by the check
    against autograd, naming the weight; no grad1 written; a real batch next trains."""
    model = mlp()
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.CheckFailedError, match=r"'0\.weight'"):
            F.cross_entropy(model(model[0].weight[:, :3]), y).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        x, y = batch(1)
        want = loop_grad(model, F.cross_entropy, x, y)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "the next step")


class PerSource(nn.Module):
    """One layer run on each tensor of a list; outputs concatenated or returned apart."""

    def __init__(self, join: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.join = nn.Linear(3, 2), join

    def forward(self, xs: list):
        outs = [self.layer(x) for x in xs]
        return torch.cat(outs) if self.join else tuple(outs)


@pytest.mark.parametrize("join", [True, False], ids=["concatenated", "apart"])
def test_a_list_of_inputs_of_different_batch_sizes_is_refused(join):
    """``model([x_a, x_b])`` with 4 and 2 rows (two datasets in one forward): gradhooks takes
    the batch from the first, so the second's rows are no examples of it. Refused before any
    grad1 is written: concatenated, as mixing the 4 examples; returned apart, as a layer
    whose input, without the batch, may have been given with another number of rows."""
    model = PerSource(join).to(D)
    xs = [batch(0, n=4)[0], batch(1, n=2)[0]]
    refused = (
        pytest.raises(gradhooks.MixedExamplesError, match=r"4 examples")
        if join
        else pytest.raises(gradhooks.BatchNotFoundError, match=r"'layer'.*another number of rows")
    )
    with gradhooks.add_hooks(model):
        with refused:
            out = model(xs)
            sum(o.pow(2).sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_the_next_batch_loaded_into_a_static_buffer_before_the_backward_is_refused():
    """A prefetching loop that loads batches into halves of one static buffer and fills the
    other half while the step runs: written between the forward and its backward, the buffer's
    version moves under the view the first layer saved. torch refuses it without gradhooks;
    with hooks, a ``StateError`` names the layer and the shape, and nothing is written. With the
    first layer's weight frozen (only its bias trained, as in BitFit) torch would not need the
    input, but gradhooks keeps it to follow the batch: refused all the same. Loaded after the
    backward, grad1 is the loop's at every step."""
    for frozen in (False, True):
        model = mlp()
        model[0].weight.requires_grad_(not frozen)
        buffer = torch.zeros(10, 3, dtype=D)
        with gradhooks.add_hooks(model):
            x, y = batch(0)
            buffer[:5].copy_(x)
            out = model(buffer[:5])
            buffer[5:].copy_(batch(1)[0])
            with pytest.raises(gradhooks.StateError, match=r"'0' \(Linear\).*\(5, 3\)"):
                F.cross_entropy(out, y).backward()
            assert not any(hasattr(p, "grad1") for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            half = buffer[5:] if step % 2 else buffer[:5]
            x, y = batch(step + 1)
            half.copy_(x)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(half), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_load_state_dict_with_assign_between_the_forward_and_its_backward():
    """``load_state_dict(state, assign=True)`` between a forward and its backward (a resume
    that lands mid-step): the backward runs through the graph of the old parameters, so
    ``.grad`` and grad1 go to those, the loop's; the new ones get neither, and the next step,
    through the new ones, is theirs."""
    model = mlp()
    state = {k: v.clone() * 1.1 for k, v in model.state_dict().items()}
    old = dict(model.named_parameters())
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        out = model(x)
        model.load_state_dict(state, assign=True)
        F.cross_entropy(out, y).backward()
        for n, p in model.named_parameters():
            assert p is not old[n] and p.grad is None and not hasattr(p, "grad1"), n
            assert_close(old[n].grad1, want[n], f"old {n}")
        x, y = batch(1)
        want = loop_grad(model, F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "the step after")


def _metadata_first() -> dict:
    x = batch(0)[0]
    return {"meta": {"temperature": torch.tensor([2.0], dtype=D)},
            "inputs": {"x": x, "weight": torch.ones(5, 1, dtype=D)}}  # fmt: skip


def test_a_nested_batch_whose_first_tensor_is_metadata_is_refused():
    """A nested dict whose first tensor is not the batch (a temperature of shape ``(1,)``
    ahead of the inputs): gradhooks takes the batch from the first tensor, so it counts one
    example and finds the layers' inputs without it. Refused with a typed error at the
    backward, after a warning; nothing is written; the batch put first trains."""
    model = DictModel().to(D)
    y = batch(0)[1]
    with gradhooks.add_hooks(model):
        with pytest.warns(gradhooks.GradhooksWarning):  # (the next test's)
            with pytest.raises(gradhooks.BatchNotFoundError, match=r"'head' \(Linear\)"):
                F.cross_entropy(model(_metadata_first()), y).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        first = _metadata_first()
        first = {"inputs": first["inputs"], "meta": first["meta"]}
        want = loop_over(model, [{"inputs": {k: v[i : i + 1] for k, v in first["inputs"].items()},
                                  "meta": first["meta"]} for i in range(5)], y)  # fmt: skip
        F.cross_entropy(model(first), y).backward()
    assert_grad1(model, want, "the batch first")


def test_a_batch_taken_from_metadata_is_told_where_it_was_taken_from():
    """Before the refusal above, a ``GradhooksWarning`` at the forward says that the batch of
    1 was taken from dimension 0 of ``batch['meta']['temperature']``, of shape ``(1,)``, while
    the other tensors have 5 rows; a batch whose other tensors share its rows (here, a batch of
    one) is not warned about."""
    model = DictModel().to(D)
    with gradhooks.add_hooks(model):
        with pytest.warns(gradhooks.GradhooksWarning, match=r"\['temperature'\] \(1,\).*5 rows"):
            with pytest.raises(gradhooks.BatchNotFoundError):
                F.cross_entropy(model(_metadata_first()), batch(0)[1]).backward()
        x, y = batch(0, n=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gradhooks.GradhooksWarning)
            one = {"inputs": {"x": x, "weight": torch.ones(1, 1, dtype=D)},
                   "meta": {"temperature": torch.tensor([2.0], dtype=D)}}  # fmt: skip
            F.cross_entropy(model(one), y).backward()

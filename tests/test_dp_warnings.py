"""What a DP step says of the examples it does not protect.

Two warnings, from ``gradhooks.dp_sgd_step`` and from its variant across ranks,
``gradhooks.distributed.dp_sgd_step`` (here on a process group of one rank; two ranks in
``tests/distributed_worker.py``), each checked on the step's numbers too (a float64 loop of
each example's gradient, clipped and averaged):

- losses that reach trainable parameters the hooks are not on (a head left out of
  ``add_hooks(model.l1)``, a learned temperature outside the model): those get no gradient
  from the step (``GradhooksWarning``, naming how many and their shapes);
- a forward that took an input as long as the batch as shared by every example (DPR's
  in-batch negatives, ``scores = q @ p.T`` over the batch's passages; a memory bank given as
  an input): every example's gradient holds every row of it, so the step protects none of
  them (``SharedInputWarning``, naming the input, its shape, the operation and the calls made
  batch-free). One warning per step, whatever the number of such inputs and calls; none for
  the forwards that keep every input's rows as examples, nor for a bank as long as the batch
  that is the model's own (a buffer, a parameter), nor for a step whose forward took nothing
  as shared after one that did.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_fourteenth import one_rank  # noqa: F401  (a fixture)
from test_lib_sweep_ninth import BiEncoder
from test_misuse_fifth import clipped_mean, close
from test_misuse_seventeenth import MAX_NORM, Scaled, Smoothed, _batch, _loop
from torch import nn

import gradhooks
from harness import one_thread

D = torch.float64
B = 6
assert one_thread  # (autouse: one intra-op thread for these tiny models)

STEPS = {
    "one process": gradhooks.dp_sgd_step,
    "across ranks": gradhooks.distributed.dp_sgd_step,
}
WHERE = {
    "one process": "gradhooks.dp_sgd_step:",
    "across ranks": "gradhooks.distributed.dp_sgd_step:",
}
METHODS = [("grad1", ("grad1",)), ("bookkeeping", ("norms",)), ("ghost", ("norms",))]


@pytest.fixture(params=list(STEPS))
def step(request):
    """``(name, dp_sgd_step)``: the step of one process, or that across ranks on a process
    group of one rank."""
    if request.param == "across ranks":
        request.getfixturevalue("one_rank")
    return request.param, STEPS[request.param]


def caught(kind: type[Warning], run) -> tuple[list[str], object]:
    """The messages of the warnings of class ``kind`` that ``run()`` issued (every warning
    recorded), and what it returned."""
    found, out = caught_all(run)
    return [m for c, m in found if issubclass(c, kind)], out


def caught_all(run) -> tuple[list[tuple[type[Warning], str]], object]:
    """Every warning ``run()`` issued, ``(class, message)``, and what it returned."""
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        out = run()
    return [(w.category, str(w.message)) for w in found], out


def assert_step(model: nn.Module, want: dict, what: str, max_norm: float = MAX_NORM) -> None:
    """Every parameter's ``.grad`` is the DP step's without noise: the loop's gradients
    clipped to ``max_norm`` over the whole model, averaged."""
    mean = clipped_mean(want, max_norm)
    for n, p in model.named_parameters():
        close(p.grad, mean[n], f"{what}: {n}")


# -- parameters the hooks are not on --------------------------------------------------------


@pytest.mark.parametrize("outside", ["head", "temperature"])
def test_losses_through_parameters_the_hooks_are_not_on_warn_in_either_step(step, outside):
    """The hooks on ``model.l1`` alone and the losses through the head too, or the hooks on the
    model and the losses divided by a learned temperature outside it: each step clips the
    hooked parameters' gradients (the loop's, clipped by their norm over those alone), leaves
    the others' ``.grad`` as it was, and warns, naming the step, how many and their shapes.
    The step across ranks said nothing."""
    name, dp_sgd_step = step
    model, scale = Smoothed(), Scaled()
    scale.temperature.requires_grad_(outside == "temperature")
    hooked, left = (
        (model.l1, model.head.weight) if outside == "head" else (model, scale.temperature)
    )

    def own_loss(out, target):
        return F.cross_entropy(out / scale.temperature, target, reduction="none").sum()

    x, y = _batch(3)
    want = gradhooks.oracle.loop_grad(copy.deepcopy(model), own_loss, (x,), y)
    inside = {n: want[n] for n, p in model.named_parameters() if p in set(hooked.parameters())}
    left.grad = torch.full_like(left, 0.25)
    with gradhooks.add_hooks(hooked, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x) / scale.temperature, y, reduction="none")
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert len(said) == 1, said
    count, shapes = ("2", "(3, 6), (3,)") if outside == "head" else ("1", "()")
    for part in [WHERE[name], f"reach {count} trainable", shapes, "not the hooked model's"]:
        assert part in said[0], (part, said[0])
    mean = clipped_mean(inside, MAX_NORM)
    for n in inside:
        close(model.get_parameter(n).grad, mean[n], n)
    assert torch.equal(left.grad, torch.full_like(left, 0.25)), "the .grad left from before"


def test_the_whole_model_hooked_warns_of_nothing_in_either_step(step):
    """Hooked whole, nothing outside: no warning of gradhooks', and the step is the loop's."""
    _, dp_sgd_step = step
    model = Smoothed()
    x, y = _batch(4)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert said == []
    assert_step(model, want, "hooked whole")


def test_the_check_of_parameters_outside_is_one_function_for_both_steps():
    """Both steps find and tell the parameters outside the hooks by the same two functions
    (no second copy to drift): a walk of the losses' graph before the backward, and the
    warning after the step, which names the step that warns."""
    from gradhooks.workflows import distributed, dp

    source = {f.__name__: f for f in (dp.dp_sgd_step, distributed.dp_sgd_step)}
    for name, f in source.items():
        names = f.__code__.co_names
        assert "reached_outside" in names and "warn_if_outside" in names, name
        assert "warn_if_shared_inputs" in names, name
    model = Smoothed()
    x, y = _batch(5)
    with gradhooks.add_hooks(model.l1, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        found = dp.reached_outside(h, losses)
        assert {id(p) for p in found} == {id(model.head.weight), id(model.head.bias)}
        said, _ = caught(
            gradhooks.GradhooksWarning, lambda: dp.warn_if_outside(h, found, "somewhere")
        )
    assert len(said) == 1 and said[0].startswith("somewhere: the losses reach 2 trainable")


# -- inputs taken as shared by every example ---------------------------------------------------


DPR_NORM = 1.6  # (about the median of the questions' norms)


def dpr_batch(seed: int = 0, n: int = B):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(13, (n, 4), generator=g), torch.randint(13, (n, 5), generator=g)


def nll(log_probs: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    return -log_probs.gather(1, positive[:, None]).squeeze(1)


def dpr_loop(model: nn.Module, questions, contexts) -> dict[str, torch.Tensor]:
    """Each question's own gradient of its loss against every passage of the batch (its own
    the positive), the passage encoder's included: one backward per question, on a copy."""
    model = copy.deepcopy(model)
    names, params = zip(*model.named_parameters(), strict=True)
    rows = []
    for i in range(questions.shape[0]):
        loss = nll(model(questions[i : i + 1], contexts), torch.tensor([i])).sum()
        rows.append(torch.autograd.grad(loss, params))
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


def biencoder() -> nn.Module:
    torch.manual_seed(0)
    return BiEncoder().to(D)


@pytest.mark.parametrize("method, quantities", METHODS, ids=[m for m, _ in METHODS])
def test_in_batch_negatives_warn_once_a_step_naming_the_passages(step, method, quantities):
    """DPR's bi-encoder (``q @ p.T`` over the batch's passages, its own the positive): the
    passages, the second input, as long as the batch, are taken as shared by every question,
    so each question's clipped gradient holds every passage's, and no passage is protected.
    The step is the loop's all the same (each question against every passage, clipped and
    averaged) and says so once, naming the input's place and shape, the operation and the
    passage encoder's two calls made batch-free, with its class; the next step says it again.
    The steps said nothing."""
    name, dp_sgd_step = step
    model = biencoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for k in range(2):
            q, c = dpr_batch(k)
            want = dpr_loop(model, q, c)
            losses = nll(model(q, c), torch.arange(B))
            found, norms = caught_all(lambda losses=losses: dp_sgd_step(
                h, losses, max_norm=DPR_NORM, noise_multiplier=0.0, method=method
            ))  # fmt: skip
            assert [c for c, _ in found] == [gradhooks.SharedInputWarning], (k, found)
            said = [m for _, m in found]
            for part in [WHERE[name], f"2nd tensor input, of shape {(B, 5)}", "matmul",
                         "'ctx_model.0', 'ctx_model.1'", "shared by every example",
                         "not protected", "SharedInputWarning"]:  # fmt: skip
                assert part in said[0], (part, said[0])
            assert_step(model, want, f"step {k}", DPR_NORM)
            assert (norms > DPR_NORM).any() and (norms < DPR_NORM).any(), "clip some, not all"
            opt.step()


def test_the_warning_has_its_own_class_and_can_be_filtered_alone():
    """``SharedInputWarning`` is a ``GradhooksWarning`` (and so a ``RuntimeWarning``): filtered
    by its class, the step says nothing of the passages, and another warning of the step (the
    batch size varying) still comes."""
    assert issubclass(gradhooks.SharedInputWarning, gradhooks.GradhooksWarning)
    assert gradhooks.SharedInputWarning is gradhooks.errors.SharedInputWarning
    model = biencoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=gradhooks.SharedInputWarning)
            for n in (B, B - 1):
                q, c = dpr_batch(n, n)
                gradhooks.dp_sgd_step(
                    h, nll(model(q, c), torch.arange(n)), max_norm=1.0, noise_multiplier=0.0
                )
                opt.step()
    kinds = [w.category for w in found]
    assert gradhooks.SharedInputWarning not in kinds
    assert kinds == [gradhooks.GradhooksWarning], kinds  # (the sizes varied)


class Banked(nn.Module):
    """An encoder of the examples scored against a bank of ``K`` rows, each example's label
    the index of its row: the bank given as the forward's second input, ``bank``, or the
    model's own (``own="buffer"``: a buffer, encoded by a hooked Linear; ``"parameter"``: a
    parameter used directly), or two banks given (``bank`` and ``extra``, concatenated)."""

    def __init__(self, own: str | None = None, k: int = B) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.key = nn.Linear(4, 5), nn.Linear(3, 5)
        if own == "buffer":
            self.register_buffer("bank", torch.randn(k, 3))
        elif own == "parameter":
            self.bank = nn.Parameter(torch.randn(k, 5))
        self.own = own
        self.to(D)

    def forward(self, x, bank=None, extra=None):
        if self.own == "parameter":
            keys = self.bank
        else:
            rows = self.bank if self.own == "buffer" else bank
            if extra is not None:
                rows = torch.cat([rows, extra])
            keys = self.key(rows)
        return F.log_softmax(self.enc(x) @ keys.T, dim=1)


def banked_batch(seed: int, n: int = B):
    g = torch.Generator().manual_seed(900 + seed)
    return (
        torch.randn(n, 4, generator=g, dtype=D),
        torch.randn(n, 3, generator=g, dtype=D),
        torch.randn(n, 3, generator=g, dtype=D),
    )


def test_two_inputs_taken_as_shared_make_one_warning_naming_both(step):
    """Two banks as long as the batch, concatenated and encoded by one hooked Linear: one
    warning for the step, naming the 2nd and the 3rd input (one operation, one call)."""
    name, dp_sgd_step = step
    model = Banked()
    x, bank, extra = banked_batch(0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = nll(model(x, bank, extra), torch.arange(B))
        said, _ = caught(gradhooks.SharedInputWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert len(said) == 1, said
    for part in [WHERE[name], "2nd tensor input", "3rd tensor input", "'key'"]:
        assert part in said[0], (part, said[0])


@pytest.mark.parametrize("own", ["buffer", "parameter"])
def test_a_bank_as_long_as_the_batch_that_is_the_models_own_does_not_warn(step, own):
    """The bank the model's own, a buffer of ``B`` rows encoded by a hooked Linear, or a
    parameter of ``B`` rows used directly: no input is taken as shared (the bank is no
    example's data), no warning of gradhooks', and the step is the loop's."""
    _, dp_sgd_step = step
    model = Banked(own)
    x, _, _ = banked_batch(1)
    y = torch.arange(B)
    want = gradhooks.oracle.loop_grad(
        copy.deepcopy(model), lambda out, t: nll(out, t).sum(), (x,), y
    )
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = nll(model(x), y)
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert said == []
    assert_step(model, want, own)


class Weighted(nn.Module):
    """An MLP whose second input, as long as the batch, holds each example's own rows: a
    per-feature weight multiplied into its input row by row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)

    def forward(self, x, w):
        return self.net(x * w)


def test_a_second_input_holding_each_examples_rows_does_not_warn(step):
    """A second input as long as the batch combined with the first row by row: it holds the
    examples, is protected with them, and no warning comes; the step is the loop's."""
    _, dp_sgd_step = step
    model = Weighted()
    x, y = _batch(6, B)
    w = torch.rand(B, 4, generator=torch.Generator().manual_seed(2), dtype=D)
    want = gradhooks.oracle.loop_grad(copy.deepcopy(model), F.cross_entropy, (x, w), y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x, w), y, reduction="none")
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert said == []
    assert_step(model, want, "weighted")


def test_a_step_warns_of_its_own_forward_alone():
    """One handle, two steps: the first on a forward with a bank given (it warns), the second
    on a forward of the model's own buffer, with the same shapes (it does not): what the step
    says is of the forward its losses came from, not of an earlier one's."""
    model = Banked()
    x, bank, _ = banked_batch(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        first, _ = caught(gradhooks.SharedInputWarning, lambda: gradhooks.dp_sgd_step(
            h, nll(model(x, bank), torch.arange(B)), max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
        model.register_buffer("bank", bank.clone())
        model.own = "buffer"
        second, _ = caught(gradhooks.SharedInputWarning, lambda: gradhooks.dp_sgd_step(
            h, nll(model(x), torch.arange(B)), max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert len(first) == 1 and second == [], (first, second)


def test_a_step_of_hooks_whose_model_was_collected_is_refused():
    """``add_hooks(model[:-1])`` on a slice nothing else holds: the handle keeps its model
    weakly, so once the slice is collected its layers still run with the hooks while the step
    has no model to name them by. Refused with a ``StateError`` naming the hooked layers, and
    nothing written."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    h = gradhooks.add_hooks(model[:-1])
    gc.collect()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(2, (5,))
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(gradhooks.StateError, match=r"gone.*'0' \(Linear\)"):
        gradhooks.dp_sgd_step(h, losses, max_norm=MAX_NORM, noise_multiplier=0.0)
    assert all(p.grad is None for p in model.parameters())
    h.remove()


def test_dp_optimizer_and_clipped_sum_warn_of_shared_inputs_and_outside_parameters():
    """``DPOptimizer.backward`` (and ``make_private``, through it) and ``clipped_sum`` warn as
    the step does, naming themselves: in-batch negatives once per physical batch, and a head
    the hooks are not on; their sums are the loop's, clipped."""
    model = biencoder()
    q, c = dpr_batch(3)
    want = dpr_loop(model, q, c)
    opt = gradhooks.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), gradhooks.add_hooks(model),
        noise_multiplier=0.0, max_grad_norm=DPR_NORM, expected_batch_size=B,
    )  # fmt: skip
    found, _ = caught_all(lambda: opt.backward(nll(model(q, c), torch.arange(B))))
    assert [k for k, _ in found] == [gradhooks.SharedInputWarning], found
    assert "DPOptimizer.backward:" in found[0][1], found[0][1]
    opt.step()
    assert_step(model, want, "DPOptimizer", DPR_NORM)
    opt.hooks.remove()

    model, x, y = Smoothed(), *_batch(3)
    with gradhooks.add_hooks(model.l1) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        said, got = caught(gradhooks.GradhooksWarning, lambda: gradhooks.clipped_sum(
            h, losses, max_norm=MAX_NORM
        ))  # fmt: skip
    assert len(said) == 1 and "gradhooks.clipped_sum:" in said[0], said
    assert "reach 2 trainable" in said[0], said[0]

"""Mistakes in how a model is hooked, trained and stepped, an eighth set: K-FAC given labels
that are no class of the output; a rule of your own whose ``Rows`` piece points past its
table or its batch; ``make_private`` given a δ of 1 / (number of examples) or more; hooks
added to a model without parameters; weights changed in place between the forward and the
backward under ``allow_mutation_on_saved_tensors()`` for the rules that read them (recurrent
layers, ``EmbeddingBag(mode="max")``, the fallback under bfloat16 autocast); ``grad1`` set by
hand; counts of steps and examples of inf or NaN; ``make_private`` given another model's
optimizer; ``batch_dim`` set to the features; DP losses coupled by a statistic of the batch;
one example without its batch dimension given to a DP step, to ``jacobians`` and to
``kfac``; ``check`` given another batch, a handle without ``grad1`` or a loss scaled by the
outputs' spread; a model cast to another dtype after ``add_hooks``; ``rescale``, the DP
step and ``DPOptimizer`` given arguments they do not take. Each gives the documented
meaning, compared in float64 with each example's own gradient by the per-example loop
(:func:`gradhooks.oracle.loop_grad`) or ``torch.func``, or stops with the typed error (or
warning) of its kind, whose message names what was refused, leaving the parameters,
``.grad``, ``grad1``, the buffers and the hooks as they were (``tests/test_misuse.py`` to
``tests/test_misuse_seventh.py`` hold the earlier sets)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import assert_all_untouched, close, full_state, loop
from torch import nn
from torch.autograd.graph import allow_mutation_on_saved_tensors
from torch.utils.data import TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    for name, p in model.named_parameters():
        close(p.grad1, want[name], f"{what}: {name}")


# -- the known ones, fixed -------------------------------------------------------------------------


@pytest.mark.parametrize("labels", ["past-the-head", "negative"])
def test_kfac_of_labels_that_are_no_class_of_the_output(labels):
    """``kfac(model, x, y, fisher="empirical")`` with a label past the model's outputs (a
    dataset of more classes than the head) failed inside gradhooks with torch's bare
    ``RuntimeError`` from ``F.one_hot``; a label of -1 was taken for class 0, silently. Both
    are refused, naming the label, its place and the output's classes; -100 (the ignored
    label) still adds nothing, as in ``F.cross_entropy``."""
    model = mlp()
    x, y = labelled_batch(1)
    before = full_state(model)
    bad = y + 2 if labels == "past-the-head" else y - 2
    raised(gradhooks.ConfigurationError,
           ["kfac(fisher='empirical'", f"target[0] is {int(bad[0])}", "(5, 2) has 2 classes"],
           lambda: gradhooks.kfac(model, x, bad, fisher="empirical"))  # fmt: skip
    assert_all_untouched(model, before)
    ignored = y.clone()
    ignored[0] = -100
    got = gradhooks.kfac(model, x, ignored, fisher="empirical")
    kept = gradhooks.kfac(model, x[1:], y[1:], fisher="empirical")
    # (G sums the kept examples' output-gradients: the batch of 5 divides it, not of 4)
    close(got["2.weight"].G * 5, kept["2.weight"].G * 4, "G without the ignored example")


def rows_past_the_table(call):
    """An embedding's rule of your own that shifts every index by one (an off-by-one of a
    table indexed from 1): the last row's lookups point past the table."""
    idx, g = call.inputs[0], call.grad_output
    batch, positions = idx.shape
    example = torch.arange(batch).repeat_interleave(positions)
    weight = call.module.weight
    return {"weight": gradhooks.Rows(example, idx.reshape(-1) + 1, g.reshape(batch * positions, -1),
                                     batch, weight.shape[0])}  # fmt: skip


class MyEmbedding(nn.Embedding):
    def forward(self, idx):
        return super().forward(idx)


def test_a_rows_piece_of_an_index_past_its_table_or_an_example_past_its_batch():
    """A rule of your own that returns ``Rows(example, index, g, batch, num_rows)`` with an
    index past ``num_rows`` got that row added to the next example's rows of ``grad1``,
    silently. Refused where the piece is made (and so in the backward, naming the rule and
    the module), as is an example past ``batch``; the model is left as it was."""
    raised(gradhooks.RuleError, ["Rows(index=...) holds 3", "num_rows=3"],
           lambda: gradhooks.Rows(torch.tensor([0, 1]), torch.tensor([3, 0]), torch.ones(2, 1),
                                  2, 3))  # fmt: skip
    raised(gradhooks.RuleError, ["Rows(example=...) holds 2", "batch=2"],
           lambda: gradhooks.Rows(torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2, 1),
                                  2, 3))  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(MyEmbedding(6, 3), nn.Flatten(), nn.Linear(12, 2)).to(D)
    registry = gradhooks.Registry()
    registry.register(MyEmbedding)(rows_past_the_table)
    registry.register(nn.Linear)(gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule)
    idx = torch.tensor([[0, 5, 2, 1], [5, 4, 3, 0]])
    before = model_state(model)
    with gradhooks.add_hooks(model, registry=registry) as h:
        raised(gradhooks.RuleError, ["rows_past_the_table", "'0' (MyEmbedding)", "holds 6"],
               lambda: model(idx).sum().backward())  # fmt: skip
        assert h.model is model
    assert_untouched(model, {**before, "grad": model_state(model)["grad"]})


def test_make_private_with_a_delta_not_below_one_over_the_dataset_warns():
    """δ is the chance that the guarantee fails outright: at δ >= 1 / n a mechanism that
    publishes one example of the n in the clear meets it, so such a δ promises nothing (DP
    practice takes δ well below 1 / n; Opacus warns too). ``make_private`` ran without a
    word; it warns now, naming δ and the dataset's size. δ below 1 / n gives no warning."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(20, 3), torch.randint(2, (20,)))
    for delta, warns in ((0.05, True), (0.5, True), (0.049, False), (1e-5, False)):
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            private = gradhooks.make_private(
                model, opt, data, delta=delta, noise_multiplier=1.0, steps=2,
                expected_batch_size=4, max_grad_norm=1.0,
            )  # fmt: skip
        private.close()
        ours = [w for w in seen if issubclass(w.category, gradhooks.GradhooksWarning)]
        assert len(ours) == warns, (delta, [str(w.message) for w in seen])
        if warns:
            message = str(ours[0].message)
            assert f"delta={delta:g}" in message and "20 examples" in message, message


@pytest.mark.parametrize(
    "make",
    [nn.ReLU, lambda: nn.Sequential(nn.Flatten(), nn.ReLU()), nn.Module],
    ids=["relu", "parameter-free-sequential", "empty-module"],
)
def test_hooks_added_to_a_model_without_parameters_are_refused(make):
    """``add_hooks(nn.ReLU())`` (a parameter-free layer hooked instead of the model) hooked
    nothing, and every backward captured nothing, without a word. Refused, naming the
    model; nothing is left on it. A model whose parameters are all frozen is still hooked:
    unfrozen later, its backward gets the loop's grad1."""
    model = make()
    before = model_state(model)
    raised(gradhooks.ConfigurationError, ["add_hooks", f"({type(model).__qualname__})",
                                          "has no parameters"],
           lambda: gradhooks.add_hooks(model))  # fmt: skip
    assert_untouched(model, before)
    frozen = mlp().requires_grad_(False)
    x, y = labelled_batch(2)
    with gradhooks.add_hooks(frozen):
        frozen.requires_grad_(True)
        F.cross_entropy(frozen(x), y).backward()
    assert_grad1(frozen, loop(frozen, x, y), "unfrozen after add_hooks")


# -- weights changed in place between the forward and the backward, under the context ---------


class Recurrent(nn.Module):
    """An LSTM and a GRU over ``[batch, 6, 3]``, an ``EmbeddingBag(mode="max")`` over
    ``[batch, 3]`` indices, and a Linear head on both: each rule but the head's reads its
    weights at the backward. In float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.gru = nn.GRU(4, 4, batch_first=True)
        self.bag = nn.EmbeddingBag(7, 4, mode="max")
        self.head = nn.Linear(8, 2)
        self.to(D)

    def forward(self, x, idx):
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return self.head(torch.cat([h[:, -1], self.bag(idx)], 1))


def test_recurrent_and_bag_weights_decayed_in_place_under_allow_mutation():
    """Under ``allow_mutation_on_saved_tensors()`` autograd keeps a copy of what it saved and
    a weight decayed in place between the forward and the backward (``p.mul_(0.9)``) leaves
    it the forward's gradient; the recurrent layers' rules and ``EmbeddingBag(mode="max")``'s,
    which read the weights at the backward, were refused with a ``StateError``. Now they
    give the float64 loop's grad1 at the weights the forward ran with, over two steps of an
    ordinary loop. Outside the context the change is refused, naming the parameter."""
    model = Recurrent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x = torch.randn(5, 6, 3, generator=g, dtype=D)
            idx = torch.randint(7, (5, 3), generator=g)
            y = torch.randint(2, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, (x, idx), y)
            opt.zero_grad()
            with allow_mutation_on_saved_tensors():
                loss = F.cross_entropy(model(x, idx), y)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.9)
                loss.backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
        loss = F.cross_entropy(model(x, idx), y)
        with torch.no_grad():
            model.lstm.weight_hh_l0.mul_(0.9)
        raised(gradhooks.StateError, ["weight_hh_l0", "'lstm'", "inplace"], loss.backward)


class Gated(nn.Module):
    """A layer without a rule (the fallback computes it), between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, h):
        return h * torch.sigmoid(self.w * h)


def test_a_layer_without_a_rule_decayed_in_place_under_allow_mutation_and_bfloat16_autocast():
    """The fallback's weight decayed in place under ``allow_mutation_on_saved_tensors()``,
    in a float32 model trained under bfloat16 autocast: grad1 is the float64 loop's at the
    forward's weights within bfloat16's rounding (it was refused with a ``StateError``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), Gated(), nn.Linear(6, 2))
    x, y = labelled_batch(3)
    want = loop_grad(model.to(D), F.cross_entropy, x, y)
    model.float()
    with gradhooks.add_hooks(model), allow_mutation_on_saved_tensors():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.float()), y)
        with torch.no_grad():
            model[1].w.mul_(0.5)
        loss.backward()
    for name, p in model.named_parameters():
        error = (p.grad1.double() - want[name]).abs().max() / want[name].abs().max()
        assert error < 3e-2, (name, float(error))


# -- grad1 set by hand ---------------------------------------------------------------------------


def test_a_grad1_set_by_hand_to_a_non_tensor_is_refused_before_the_backward_writes():
    """``p.grad1 = "..."`` (a placeholder, a list of rows) between two backwards failed inside
    the engine with a bare ``AttributeError``. Refused, naming the parameter and its layer,
    with the other parameters' grad1 and every ``.grad`` as they were; ``p.grad1 = None``
    begins anew, as ``p.grad = None`` does: the next backward's grad1 is the loop's."""
    model = mlp()
    x, y = labelled_batch(4)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        model[2].weight.grad1 = [row for row in model[2].weight.grad1]
        kept = {n: (p.grad1, p.grad.clone()) for n, p in model.named_parameters()}
        raised(gradhooks.ConfigurationTypeError,
               ["'weight' of '2' (Linear)", "grad1 of type list", "[batch, *(2, 5)]"],
               lambda: F.cross_entropy(model(x), y).backward())  # fmt: skip
        for name, p in model.named_parameters():
            assert p.grad1 is kept[name][0], name
            assert torch.equal(p.grad, kept[name][1]), name
        model[2].weight.grad1 = None
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "after grad1 = None")


def test_a_grad1_set_by_hand_for_another_batch_size_is_refused_naming_both():
    """``p.grad1 = torch.zeros(7, ...)`` between two backwards of a batch of 5, without
    ``zero_grad``: the backward would add 5 rows to 7. Refused with a ``StateError`` naming
    the parameter and both shapes, and saying the grad1 may have been set by hand; the
    ``.grad`` of the refused backward is taken back."""
    model = mlp()
    x, y = labelled_batch(5)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        model[0].weight.grad1 = torch.zeros(7, 5, 3, dtype=D)
        before = model_state(model)
        raised(gradhooks.StateError, ["grad1 of '0.weight' holds (7, 5, 3)", "set by hand",
                                      "this call gives (5, 5, 3)"],
               lambda: F.cross_entropy(model(x), y).backward())  # fmt: skip
        assert_untouched(model, before)


# -- counts that are no whole numbers ------------------------------------------------------------


def _private(**settings):
    """``make_private`` of a Linear over 20 examples; the model is checked to be left as it
    was (no hooks) when it refuses."""
    model = nn.Linear(3, 2)
    optimizer = settings.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(20, 3), torch.randint(2, (20,)))
    args = {"delta": 1e-5, "noise_multiplier": 1.0, "steps": 2, "expected_batch_size": 4,
            "max_grad_norm": 1.0, **settings}  # fmt: skip
    before = model_state(model)
    try:
        return gradhooks.make_private(model, optimizer, data, **args)
    except gradhooks.GradhooksError:
        assert_untouched(model, before)
        raise


def _kfac(**settings):
    model = mlp()
    return gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: _private(steps=INF), "steps must be a whole number >= 1, got inf"),
        (lambda: _private(max_physical_batch_size=INF), "max_physical_batch_size must be a whole number >= 1 or None, got inf"),
        (lambda: gradhooks.PoissonSampler(INF, 4), "num_examples must be a whole number >= 1, got inf"),
        (lambda: gradhooks.PoissonSampler(20, 4, steps=NAN), "steps must be a whole number >= 0, got nan"),
        (lambda: gradhooks.PrivacyAccountant().step(noise_multiplier=1.0, sample_rate=0.1, steps=INF),
         "steps must be a whole number >= 0, got inf"),
        (lambda: gradhooks.noise_multiplier_for(1.0, 1e-5, 0.1, INF), "steps must be a whole number >= 0, got inf"),
        (lambda: _kfac(factors_every=INF),
         "factors_every must be a whole number >= 1, got inf"),
    ],
    ids=["make-private-steps", "physical-batch", "sampler-examples", "sampler-steps-nan",
         "accountant-steps", "noise-search-steps", "kfac-every"],
)  # fmt: skip
def test_counts_that_are_infinite_or_nan_are_refused_naming_them(call, says):
    """A count of steps, examples or a batch size of inf or NaN failed in ``int()`` with a
    bare ``OverflowError`` or ``ValueError`` that named neither the argument nor the call (a
    fraction was refused already); each is refused as a fraction is, naming it."""
    raised(gradhooks.ConfigurationError, says, call)


def test_make_private_with_the_optimizer_of_another_model_leaves_no_hooks():
    """``make_private(model, torch.optim.SGD(other.parameters()), ...)``: the optimizer would
    step the other model on a gradient with neither clipping nor noise. Refused, naming the
    parameter's shape, with no hooks left on the model (make_private hooks it first)."""
    other = nn.Linear(3, 2)
    raised(gradhooks.ConfigurationError,
           ["parameter of shape (2, 3) that the hooks do not clip", "another model's"],
           lambda: _private(optimizer=torch.optim.SGD(other.parameters(), lr=0.1)))  # fmt: skip


# -- where the examples are -------------------------------------------------------------------------


def test_batch_dim_set_to_the_features_of_a_batch_first_input():
    """``add_hooks(model, batch_dim=1)`` for a ``[batch, features]`` input (the setting of a
    sequence-first model carried over): the first layer takes its 3 features for examples,
    the next sees 5 rows. Refused at the backward, naming the layer and both counts, with
    ``.grad`` and grad1 as they were; with the default the same step gives the loop's."""
    model = mlp()
    x, y = labelled_batch(6)
    before = model_state(model)
    with gradhooks.add_hooks(model, batch_dim=1):
        raised(gradhooks.BatchNotFoundError, ["'2' (Linear)", "for 5 examples",
                                              "the model's forward has 3"],
               lambda: F.cross_entropy(model(x), y).backward())  # fmt: skip
        assert_untouched(model, {**before, "hooks": model_state(model)["hooks"]})
    assert_untouched(model, before)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, vmap_grad(model, F.cross_entropy, x, y), "batch_dim='auto'")


@pytest.mark.parametrize(
    "losses",
    [
        lambda out, y: F.cross_entropy(out, y, reduction="none") / F.cross_entropy(out, y, reduction="none").std(),
        lambda out, y: F.cross_entropy(out - out.mean(0), y, reduction="none"),
        lambda out, y: F.cross_entropy(out, y, reduction="none") * out.std(),
    ],
    ids=["divided-by-the-batchs-std", "logits-centred-over-the-batch", "times-the-outputs-std"],
)  # fmt: skip
def test_dp_step_of_losses_coupled_by_a_statistic_of_the_batch_is_refused(losses):
    """Per-example losses divided by their batch's standard deviation, computed from logits
    centred over the batch, or scaled by the outputs' spread (``out.mean() * out.std()``'s
    kind): no example has a loss of its own, so its clipped gradient would not bound its
    influence. The DP step's check refuses each (``CheckFailedError``), naming the
    parameters, with no ``.grad`` written and the parameters as they were."""
    model = mlp()
    x, y = labelled_batch(7)
    before = full_state(model)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        raised(gradhooks.CheckFailedError, ["dp_sgd_step", "'0.weight'", "own losses"],
               lambda: gradhooks.dp_sgd_step(h, losses(model(x), y), max_norm=1.0,
                                             noise_multiplier=0.0))  # fmt: skip
    assert_all_untouched(model, before)


@pytest.mark.parametrize("kind", ["dp_sgd_step", "DPOptimizer"])
def test_a_dp_step_on_one_example_without_its_batch_dimension(kind):
    """One example given as ``x[0]`` (``[features]``, no batch dimension) to a DP step, its
    loss reshaped to ``[1]`` to pass the step's check of the losses' shape: refused with an
    ``UnbatchedInputError`` naming the last layer (the backward meets it first) and the
    shape it got, nothing written; with
    ``x[:1]`` the step's ``.grad`` is the loop's gradient clipped to the bound."""
    model = mlp()
    x, y = labelled_batch(8)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        before = full_state(model)

        def step(inputs, labels):
            losses = F.cross_entropy(model(inputs), labels, reduction="none").reshape(1)
            if kind == "dp_sgd_step":
                gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
                return
            opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), h,
                                        max_grad_norm=0.5, noise_multiplier=0.0,
                                        expected_batch_size=1)  # fmt: skip
            opt.backward(losses)
            opt.step()

        raised(gradhooks.UnbatchedInputError, ["'2' (Linear)", "input of shape (5,)",
                                               "x.unsqueeze(0)"],
               lambda: step(x[0], y[0]))  # fmt: skip
        assert_all_untouched(model, before)
        step(x[:1], y[:1])
    want = loop(model, x[:1], y[:1])
    norm = torch.cat([g.flatten() for g in want.values()]).norm()
    for name, p in model.named_parameters():
        close(p.grad, want[name][0] * min(1.0, 0.5 / float(norm)), name)


@pytest.mark.parametrize("call", ["jacobians", "kfac"])
def test_jacobians_and_kfac_of_one_example_without_its_batch_dimension(call):
    """``jacobians(model, x[0])`` and ``kfac(model, x[0], y[0])``: the model's output
    ``(2,)`` has its 2 classes where the examples should be. Refused, naming the output's
    shape and the batch the input's dimension 0 gave, with no hooks left; with ``x[:1]`` the
    Jacobian of the loss-free output is ``torch.func``'s."""
    model = mlp()
    x, y = labelled_batch(9)
    before = model_state(model)
    run = {
        "jacobians": lambda inputs, labels: gradhooks.jacobians(model, inputs),
        "kfac": lambda inputs, labels: gradhooks.kfac(model, inputs, labels),
    }[call]
    raised(gradhooks.ConfigurationError, [f"{call}(): Sequential's output (2,)",
                                          "for a batch of 3 examples", "not one per example"],
           lambda: run(x[0], y[0]))  # fmt: skip
    assert_untouched(model, before)
    if call == "jacobians":
        got = run(x[:1], y[:1])
        params = dict(model.named_parameters())
        for name, p in params.items():

            def out(t, name=name):
                return torch.func.functional_call(model, {**params, name: t}, (x[:1],))[0]

            close(got[name][0], torch.func.jacrev(out)(p.detach()), name)


def test_hooks_check_given_the_inputs_of_another_batch():
    """``h.check(loss_fn, x[:3], y[:3])`` after a backward of 5 examples (the validation
    batch passed by mistake): the report cannot compare 3 examples with 5 rows of grad1.
    ``CheckFailedError`` naming both counts, grad1 and ``.grad`` as they were; the right
    inputs pass."""
    model = mlp()
    x, y = labelled_batch(10)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        raised(gradhooks.CheckFailedError, ["grad1 has 5 examples, the inputs given have 3"],
               lambda: h.check(F.cross_entropy, x[:3], y[:3]))  # fmt: skip
        assert_untouched(model, before)
        assert h.check(F.cross_entropy, x, y).ok


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_a_model_cast_to_another_dtype_after_add_hooks(dtype):
    """``model.to(dtype)`` after ``add_hooks`` (the hooks added first, the precision chosen
    later): the parameters keep their identity, so the hooks follow them. grad1 is of the
    new dtype and within its rounding of the float64 loop's, over two steps of an ordinary
    loop with an optimizer."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    within = 1e-5 if dtype == torch.float32 else 3e-2  # (a few units of the last bit)
    with gradhooks.add_hooks(model):
        model.to(dtype)
        for step in range(2):
            x, y = labelled_batch(11 + step)
            reference = mlp()
            reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            want = loop(reference, x.to(dtype).double(), y)
            opt.zero_grad()
            F.cross_entropy(model(x.to(dtype)), y).backward()
            for name, p in model.named_parameters():
                assert p.grad1.dtype == dtype, name
                error = (p.grad1.double() - want[name]).abs().max() / want[name].abs().max()
                assert error < within, (step, name, float(error))
            opt.step()


def test_rescale_given_a_reduction_it_does_not_know_names_it():
    """``h.rescale("avg")`` (or a number) after a backward: refused naming its argument,
    ``loss_reduction``, with grad1 as it was (the message named autograd-hacks'
    ``loss_type`` only)."""
    model = mlp()
    x, y = labelled_batch(13)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        for bad in ("avg", 3):
            raised(gradhooks.ConfigurationError,
                   ["rescale: loss_reduction", "must be 'mean' or 'sum'", f"got {bad!r}"],
                   lambda bad=bad: h.rescale(bad))  # fmt: skip
        assert_untouched(model, before)


# -- the DP step's arguments ------------------------------------------------------------------------


def _norms_step(**settings):
    """A ``dp_sgd_step`` on a batch of the float64 MLP, hooked for norms; the model is checked
    to be left as it was where the step refuses."""
    model = mlp()
    x, y = labelled_batch(14)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = settings.pop("losses", lambda out, y: F.cross_entropy(out, y, reduction="none"))
        before = full_state(model)
        try:
            return gradhooks.dp_sgd_step(h, losses(model(x), y), **{
                "max_norm": 1.0, "noise_multiplier": 1.0, **settings
            })  # fmt: skip
        except gradhooks.GradhooksError:
            assert_all_untouched(model, before)
            raise


@pytest.mark.parametrize(
    "settings, error, says",
    [
        ({"losses": lambda out, y: F.cross_entropy(out, y, reduction="none").detach()},
         gradhooks.ConfigurationError, "per_example_loss has no autograd history"),
        ({"method": "fast"}, gradhooks.ConfigurationError, "method must be 'grad1', 'ghost' or 'bookkeeping', got 'fast'"),
        ({"clipping": "soft"}, gradhooks.ConfigurationError, "clipping must be one of ('flat', 'automatic'), got 'soft'"),
        ({"generator": "seed"}, gradhooks.ConfigurationTypeError, "generator must be a torch.Generator or None, got str"),
        ({"reduction": "avg"}, gradhooks.ConfigurationError, "reduction must be 'mean' or 'sum', got 'avg'"),
    ],
    ids=["detached-losses", "unknown-method", "unknown-clipping", "generator-by-its-seed",
         "unknown-reduction"],
)  # fmt: skip
def test_dp_step_given_losses_without_history_or_options_it_does_not_have(settings, error, says):
    """Losses detached (computed for a log, then passed), a method, a clipping or a
    reduction by a name the step does not have, a seed where a generator goes: each refused
    naming the argument and what it takes, before any backward, with nothing written."""
    raised(error, says, lambda: _norms_step(**settings))


def test_a_dp_optimizer_wrapped_in_another_is_refused():
    """``DPOptimizer(DPOptimizer(sgd, h, ...), h, ...)`` (make_private's optimizer wrapped
    again by habit) would clip and noise every step twice. Refused when the outer one is
    made, naming what it got; the inner one still steps as the loop's clipped mean."""
    model = mlp()
    x, y = labelled_batch(15)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        settings = {"max_grad_norm": 0.5, "noise_multiplier": 0.0, "expected_batch_size": 5}
        inner = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), h, **settings)
        before = full_state(model)
        raised(gradhooks.ConfigurationTypeError, "wraps a torch.optim.Optimizer (SGD, AdamW, ...), got DPOptimizer",
               lambda: gradhooks.DPOptimizer(inner, h, **settings))  # fmt: skip
        assert_all_untouched(model, before)
        inner.backward(F.cross_entropy(model(x), y, reduction="none"))
        inner.step()
    want = loop(model, x, y)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    factors = (0.5 / norms).clamp(max=1.0)
    for name, p in model.named_parameters():
        close(p.grad, torch.einsum("b,b...->...", factors, want[name]) / 5, name)


def test_check_of_a_handle_without_grad1_says_there_is_nothing_to_compare():
    """``h.check(loss_fn, x, y)`` on a handle hooked for ``("norms",)`` only: there is no
    grad1 to compare with a recomputation. ``CheckFailedError`` saying to hook with
    ``quantities=('grad1', 'norms')``, the norms as they were (the loop's)."""
    model = mlp()
    x, y = labelled_batch(16)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        F.cross_entropy(model(x), y).backward()
        norms = h.norms().clone()
        raised(gradhooks.CheckFailedError, ["this handle computes ('norms',)",
                                            "quantities=('grad1', 'norms')"],
               lambda: h.check(F.cross_entropy, x, y))  # fmt: skip
        close(h.norms(), norms, "norms after the check")
    want = loop(model, x, y)
    close(norms, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "norms")


def test_check_of_a_loss_scaled_by_the_spread_of_the_batchs_outputs():
    """``loss = out.mean() * out.std()``, computed after the model's forward: each example's
    share of the gradient is no gradient of a loss of its own (its output moves the
    others' factor), and a backward outside the forward is not followed, so ``grad1`` holds
    the shares (they still sum to ``.grad``). ``h.check(loss_fn, x)`` says so
    (``CheckFailedError`` naming the examples it compared), grad1 and ``.grad`` as they
    were."""
    model = mlp()
    x, _ = labelled_batch(17)

    def spread(out, target=None):
        return out.mean() * out.std()

    with gradhooks.add_hooks(model) as h:
        spread(model(x)).backward()
        for name, p in model.named_parameters():
            close(p.grad1.sum(0), p.grad * 5, f"shares of {name} sum to .grad")
        before = model_state(model)
        raised(gradhooks.CheckFailedError, ["grad1 of the first 2 examples is not their own"],
               lambda: h.check(spread, x))  # fmt: skip
        assert_untouched(model, before)

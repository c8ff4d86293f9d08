"""The typed errors: one hierarchy under GradhooksError, each class also the builtin its sites
raised before, and for each class a refusal through the public API that raises exactly it."""

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhooks
from gradhooks import errors

# Each class, with the builtin(s) that existing `except` clauses may name.
BUILTINS = {
    gradhooks.ConfigurationError: (ValueError,),
    gradhooks.ConfigurationTypeError: (ValueError, TypeError),
    gradhooks.StateError: (RuntimeError,),
    gradhooks.BatchNotFoundError: (RuntimeError,),
    gradhooks.UnbatchedInputError: (RuntimeError, ValueError),
    gradhooks.MixedExamplesError: (RuntimeError,),
    gradhooks.UnsupportedError: (NotImplementedError, RuntimeError),
    gradhooks.UnsupportedInputError: (NotImplementedError, RuntimeError, ValueError),
    gradhooks.UnsupportedModuleError: (NotImplementedError, RuntimeError, TypeError),
    gradhooks.RuleError: (RuntimeError,),
    gradhooks.CheckFailedError: (AssertionError, RuntimeError),
    gradhooks.NumericalError: (FloatingPointError,),
    gradhooks.MissingDependencyError: (ImportError,),
    gradhooks.Grad1TooLarge: (MemoryError, RuntimeError),
    gradhooks.PrivacyBudgetExceeded: (RuntimeError,),
}


def _error_classes():
    return [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and not issubclass(c, Warning)
    ]


@pytest.mark.parametrize("cls", list(BUILTINS), ids=lambda c: c.__name__)
def test_each_error_is_a_gradhooks_error_and_its_builtin(cls):
    assert issubclass(cls, gradhooks.GradhooksError)
    for builtin in BUILTINS[cls]:
        assert issubclass(cls, builtin), (cls, builtin)
    assert cls.__doc__ and len(cls.__doc__) > 80, "says when it is raised and what to do"
    assert cls.__name__ in gradhooks.__all__ and getattr(gradhooks, cls.__name__) is cls


def test_every_error_class_is_listed_and_exported():
    found = set(_error_classes())
    assert found == {gradhooks.GradhooksError, *BUILTINS}, found ^ {
        gradhooks.GradhooksError,
        *BUILTINS,
    }
    assert gradhooks.GradhooksError.__bases__ == (Exception,)
    assert not issubclass(gradhooks.GradhooksWarning, gradhooks.GradhooksError)
    assert set(errors.__all__) >= {c.__name__ for c in found}


def test_describe_module_names_the_module_and_its_class():
    model = nn.Sequential(nn.Linear(2, 2))
    assert errors.describe_module("0", model[0]) == "'0' (Linear)"
    assert errors.describe_module("", model) == "'<model>' (Sequential)"


# -- the modules converted to typed errors raise no bare builtin --------------------------------

ROOT = Path(gradhooks.__file__).parent
TYPED = [
    "privacy/accounting.py", "privacy/audit.py", "privacy/sampling.py",
    "quantities/collector.py", "quantities/kfac.py", "rules/attention.py",
    "rules/batch_norm.py", "rules/conv.py", "rules/conv_transpose.py", "rules/embedding.py",
    "rules/linear.py", "rules/norm.py", "rules/prelu.py", "rules/registry.py", "rules/rnn.py",
    "rules/transformer.py", "workflows/check.py", "workflows/distributed.py",
    "workflows/dp.py", "workflows/jacobian.py", "workflows/kfac.py",
    "workflows/kfac_optimizer.py", "workflows/private.py", "workflows/hf.py", "compat.py",
    "_torch.py",
    "tuning.py", "loop.py",
    "engine/api.py", "engine/backprops.py", "engine/backward.py", "engine/calls.py",
    "engine/capture.py", "engine/forward.py", "engine/handle.py", "engine/memory.py",
    "engine/plan.py", "engine/records.py", "engine/verify.py", "tracking/layout.py",
    "rules/fallback.py",
]  # fmt: skip
BARE = {
    "ValueError", "TypeError", "RuntimeError", "AssertionError", "FloatingPointError",
    "ImportError", "MemoryError", "IndexError", "KeyError",
}  # fmt: skip


@pytest.mark.parametrize("path", TYPED)
def test_no_bare_builtin_is_raised(path):
    """``NotImplementedError`` stays for abstract methods (``raise NotImplementedError``
    without a message); every other refusal is a GradhooksError."""
    tree = ast.parse((ROOT / path).read_text())
    bare = [
        f"{path}:{node.lineno} raises {node.exc.func.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and (node.exc.func.id in BARE or node.exc.func.id == "NotImplementedError")
    ]
    assert not bare, bare


# -- one refusal of each class, through the public API ------------------------------------------


def test_configuration_error_leaves_the_gradients_alone():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = model(torch.randn(4, 3)).sum(1)
        with pytest.raises(gradhooks.ConfigurationError, match="max_norm"):
            gradhooks.dp_sgd_step(h, losses, max_norm=0.0, noise_multiplier=1.0)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.PoissonSampler(10, 20)  # expected batch size above the dataset's


def test_configuration_type_error():
    with pytest.raises(gradhooks.ConfigurationTypeError):
        gradhooks.Registry().register(int)(lambda call: {})
    with pytest.raises(gradhooks.ConfigurationTypeError):
        with gradhooks.tuned(no_such_threshold=1):
            pass


def test_state_error_before_any_backward():
    model = nn.Linear(3, 2)
    gradhooks.add_hooks(model)
    try:
        with pytest.raises(gradhooks.StateError):
            gradhooks.compute_grad1(model)
    finally:
        gradhooks.remove_hooks(model)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x, z):
        return self.a(x).sum() + self.b(z).sum()


def test_batch_not_found_when_layers_see_different_batches():
    model = _TwoInputs()
    with gradhooks.add_hooks(model, quantities=("norms",), batch_dim=None):
        out = model(torch.randn(4, 3), torch.randn(6, 3))
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"\[4, 6\]"):
            out.backward()


def test_unbatched_input():
    conv = nn.Conv1d(2, 3, 3)
    with gradhooks.add_hooks(conv), pytest.raises(gradhooks.UnbatchedInputError, match="'<model>'"):
        conv(torch.randn(2, 5)).sum().backward()  # [channels, length]: no batch


def test_mixed_examples_by_batch_norm_in_training():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError, match="'1'"):
        model(torch.randn(5, 3)).sum().backward()


def test_unsupported_layer_setting():
    bag = nn.EmbeddingBag(4, 3, scale_grad_by_freq=True)
    with gradhooks.add_hooks(bag), pytest.raises(gradhooks.UnsupportedError):
        bag(torch.randint(0, 4, (2, 3))).sum().backward()
    assert not hasattr(bag.weight, "grad1")


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w, x + self.w


def test_rule_error_names_the_module():
    """A rule that reads ``call.grad_output`` of an output the loss does not use."""
    registry = gradhooks.Registry()

    @registry.register(_Pair)
    def pair(call):
        g = call.grad_output
        return {"w": gradhooks.Direct(g * call.inputs[0])}

    model = _Pair()
    with gradhooks.add_hooks(model, registry=registry):
        out = model(torch.randn(4, 3))[1].sum()
        with pytest.raises(gradhooks.RuleError, match=r"'<model>' \(_Pair\)"):
            out.backward()


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.scale


def test_check_failed_for_a_wrong_rule():
    registry = gradhooks.Registry()

    @registry.register(_Scale)
    def twice(call):  # twice the right gradient
        return {"scale": gradhooks.Direct(2 * call.inputs[0] * call.grad_output)}

    with pytest.raises(gradhooks.CheckFailedError, match="scale"):
        gradhooks.check_rule(_Scale(), torch.randn(5, 4), registry=registry)


def test_numerical_error_after_a_diverged_step():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    x[0, 0] = float("nan")
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gradhooks.NumericalError, match=r"'0\.weight'"):
        opt.step(x)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_missing_dependency(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting fails
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, steps=3)
    with pytest.raises(gradhooks.MissingDependencyError, match="pip install"):
        accountant.epsilon(1e-5)


def test_grad1_too_large_is_a_gradhooks_error():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model, max_grad1_bytes=10, batch_dim=0):
        with pytest.raises(gradhooks.GradhooksError) as refused:
            model(torch.randn(8, 3))
    assert type(refused.value) is gradhooks.Grad1TooLarge


def test_privacy_budget_exceeded_is_a_gradhooks_error():
    model = nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
        steps=1, expected_batch_size=4, max_grad_norm=1.0, delta=1e-5,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    try:
        for x, y in private.batches():
            private.backward(F.cross_entropy(model(x), y, reduction="none"))
            private.step()
        with pytest.raises(gradhooks.GradhooksError) as refused:
            next(iter(private.batches()))
        assert type(refused.value) is gradhooks.PrivacyBudgetExceeded
    finally:
        private.close()


def test_a_torch_error_is_not_a_gradhooks_error():
    """``except GradhooksError`` catches gradhooks' refusals only: a shape error of the model
    itself stays torch's."""
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model):
        with pytest.raises(RuntimeError) as raised:
            model(torch.randn(4, 5))  # 5 features into a Linear(3, 2)
    assert not isinstance(raised.value, gradhooks.GradhooksError)


# -- the refusals of the hooks themselves (a forward or a backward), each its own class -----------


class _Between(nn.Module):
    """Two Linear layers with an operation between them."""

    def __init__(self, between):
        super().__init__()
        self.l1, self.l2, self.between = nn.Linear(3, 4), nn.Linear(4, 2), between

    def forward(self, x):
        return self.l2(self.between(self.l1(x)))


def _raised(cls, fn, match=None):
    """``fn()`` raises exactly ``cls`` (not a subclass, not a sibling)."""
    with pytest.raises(gradhooks.GradhooksError, match=match) as refused:
        fn()
    assert type(refused.value) is cls, (type(refused.value), refused.value)
    return refused.value


def test_mixed_examples_from_an_input_centred_over_the_batch():
    model = _Between(lambda h: h - h.mean(0))
    with gradhooks.add_hooks(model):
        e = _raised(
            gradhooks.MixedExamplesError,
            lambda: model(torch.randn(5, 3)).sum().backward(),
            r"'l2' \(Linear\)",
        )
    assert isinstance(e, RuntimeError)
    assert all(p.grad is None for p in model.parameters())


def test_batch_not_found_when_the_examples_are_reordered():
    perm = torch.tensor([2, 0, 3, 1])
    model = _Between(lambda h: h[perm])
    with gradhooks.add_hooks(model):
        _raised(gradhooks.BatchNotFoundError, lambda: model(torch.randn(4, 3)), "in another order")


def test_check_failed_when_grad1_does_not_add_up():
    """A loss term that uses a weight alone: the verifying backward finds that grad1 does
    not sum to the gradient autograd computed, and writes no grad1."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss = model(torch.randn(4, 3)).pow(2).sum() + model[0].weight.pow(2).sum()
        e = _raised(gradhooks.CheckFailedError, loss.backward, "does not add up.*'0.weight'")
    assert isinstance(e, AssertionError) and isinstance(e, RuntimeError)
    assert not hasattr(model[0].weight, "grad1")


def test_state_error_when_hooked_twice():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model):
        _raised(gradhooks.StateError, lambda: gradhooks.add_hooks(model), "already has")


def test_configuration_errors_of_add_hooks():
    model = nn.Linear(3, 2)
    _raised(gradhooks.ConfigurationError, lambda: gradhooks.add_hooks(model, batch_dim=-1))
    _raised(gradhooks.ConfigurationTypeError, lambda: gradhooks.add_hooks("a model"))
    with gradhooks.add_hooks(model):  # the refusals added no hooks
        pass


@pytest.mark.parametrize(
    "name, bad, good",
    [("loss_reduction", "avg", "sum"), ("batch_dim", True, 0), ("batch_dim", -1, None),
     ("max_grad1_bytes", -5, 1 << 30), ("capture", "sometimes", "marked"),
     ("unsupported", "ignore", "error")],
)  # fmt: skip
def test_a_setting_changed_on_the_handle_is_checked_as_add_hooks_checks_it(name, bad, good):
    """A handle's settings, changed after add_hooks, are refused where add_hooks refuses them:
    ``h.loss_reduction = "avg"`` was taken as "sum" (grad1 a batch-size factor off, no
    error). The handle keeps its setting; a good value is taken."""
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model) as h:
        before = getattr(h, name)
        _raised(gradhooks.ConfigurationError, lambda: setattr(h, name, bad), name)
        assert getattr(h, name) == before
        setattr(h, name, good)
        assert getattr(h, name) == good


def test_a_parameter_added_to_a_layer_and_unused_is_named_with_what_to_do():
    """A trainable parameter added to a layer with a rule, which the layer's forward never
    uses: the rule gives it no piece, and the refusal names it and says both ways it can come
    about (unused: freeze or delete it; used around the layer: parametrizations), leaving the
    gradients unwritten."""
    model = nn.Sequential(nn.Linear(3, 2))
    model[0].extra = nn.Parameter(torch.zeros(4))
    with gradhooks.add_hooks(model):
        e = _raised(
            gradhooks.RuleError, lambda: model(torch.randn(5, 3)).sum().backward(), "'extra'"
        )
    assert "does not use it (freeze it" in str(e) and "parametrizations" in str(e)
    assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())


class _NoRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w


def test_unsupported_module_without_a_rule():
    e = _raised(
        gradhooks.UnsupportedModuleError,
        lambda: gradhooks.add_hooks(_NoRule(), unsupported="error"),
        "no rule",
    )
    assert isinstance(e, TypeError) and isinstance(e, gradhooks.UnsupportedError)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_unsupported_input_nested_tensor():
    model = nn.Linear(3, 2)
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    with gradhooks.add_hooks(model):
        e = _raised(gradhooks.UnsupportedInputError, lambda: model(nested), "nested tensor")
    assert isinstance(e, ValueError) and isinstance(e, gradhooks.UnsupportedError)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda m, x: gradhooks.kfac(m, x, torch.randint(0, 3, (4,)), fisher="empirical"),
         "target has shape (4,), but the model's output (5, 3) has a batch of 5"),
        (lambda m, x: gradhooks.kfac(m, x, torch.randint(0, 3, (7,)), fisher="mc"),
         "target has shape (7,)"),
        (lambda m, x: gradhooks.kfac(m, x, torch.randn(5, 2), fisher="empirical", loss="mse"),
         "target has shape (5, 2), the model's output (5, 3)"),
        (lambda m, x: gradhooks.convert_batch_norm(5), "takes an nn.Module, got int"),
        (lambda m, x: gradhooks.check_rule(nn.Linear, x), "module instance"),
        (lambda m, x: gradhooks.set_enabled("no"), "True or False, got str 'no'"),
    ],
    ids=["kfac-target-rows", "kfac-target-unused-rows", "kfac-mse-shape", "convert-type",
         "check-rule-class", "set-enabled-str"],
)  # fmt: skip
def test_misused_arguments_are_named_and_leave_the_model_alone(call, says):
    """A target of another batch, a class for an instance, a string for a flag: each stops
    with what was given and what is wanted, before anything changes."""
    model, x = _mlp(), torch.randn(5, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gradhooks.ConfigurationError, match=re.escape(says)):
        call(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"examples": 0}, gradhooks.ConfigurationError, "an int >= 1, got 0"),
        ({"examples": -1}, gradhooks.ConfigurationError, "an int >= 1, got -1"),
        ({"loss": "cross_entropy"}, gradhooks.ConfigurationTypeError, "got str 'cross_entropy'"),
        ({"rows": 3}, gradhooks.CheckFailedError, "the target has shape (3,), the inputs a batch of 5"),
    ],
    ids=["examples-0", "examples-negative", "loss-a-string", "target-rows"],
)  # fmt: skip
def test_check_with_misused_arguments_says_what_it_wants(kwargs, error, says):
    """``h.check(loss_fn, inputs, target)`` with a target of another batch (it compared the
    first examples with whatever rows the target had), no example to recompute, or a loss
    given by name: each stops naming it."""
    model, x, y = _mlp(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    h = gradhooks.add_hooks(model)
    F.cross_entropy(model(x), y).backward()
    loss = kwargs.get("loss", F.cross_entropy)
    with pytest.raises(error, match=re.escape(says)):
        h.check(loss, x, y[: kwargs.get("rows", 5)], examples=kwargs.get("examples", 2))
    assert h.check(F.cross_entropy, x, y).ok


# -- advice that fits the case: each refusal says what applies to it ----------------------------


def _untouched(model: nn.Module) -> bool:
    return all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())


class _WithTable(nn.Module):
    """``x * w``, plus a table of its own size (not the batch's) that the output uses."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, table):
        return x * self.w + table.sum()


def _scale_rule(call):  # right on a batch [batch, 4]; fails on one example [4]
    return {"w": gradhooks.Direct(torch.einsum("bf,bf->bf", call.inputs[0], call.grad_output))}


def _outer_of_2d(call):  # a rule's own bug: Outer takes [batch, shared, features]
    return {"w": gradhooks.Outer(call.inputs[0], call.grad_output)}


def _table_rule(call):  # reads the table, which has another dimension 0 than the batch
    return {"w": gradhooks.Direct(torch.einsum("bf,bf->bf", call.inputs[1], call.grad_output))}


@pytest.mark.parametrize(
    "rule, inputs, batched",
    [
        (_outer_of_2d, (torch.randn(5, 4), torch.randn(5, 4)), True),
        (_scale_rule, (torch.randn(4), torch.randn(2, 4)), False),
        (_table_rule, (torch.randn(5, 4), torch.randn(6, 4)), False),
    ],
    ids=["rule-bug-on-a-batch", "one-example-without-batch", "batch-sizes-differ"],
)
def test_a_failed_rule_is_told_to_add_a_batch_only_where_one_may_lack(rule, inputs, batched):
    """A rule that fails on a call whose tensors agree on dimension 0 failed for a reason of
    its own (the advice to add a batch dimension sent its author to the input); the advice
    stays where it can apply: an input of fewer than 2 dimensions, or dimensions 0 that
    differ."""
    registry = gradhooks.Registry()
    registry.register(_WithTable)(rule)
    model = _WithTable()
    with gradhooks.add_hooks(model, registry=registry, batch_dim=None):
        out = model(*inputs).sum()
        e = _raised(gradhooks.RuleError, out.backward, r"'<model>' \(_WithTable\)")
    unsqueeze = "x.unsqueeze(0)" in str(e)
    assert unsqueeze is not batched, str(e)
    assert (f"the rule's own: fix {rule.__module__}.{rule.__qualname__}" in str(e)) is batched
    assert _untouched(model)


class _EachRow(nn.Module):
    """Its first layer run on each example alone, in a loop over the batch."""

    def __init__(self, rows):
        super().__init__()
        self.a, self.b, self.rows = nn.Linear(3, 4), nn.Linear(4, 2), rows

    def forward(self, x):
        outs = [self.a(row) for row in self.rows(x)]
        return self.b(torch.stack(outs) if outs[0].dim() == 1 else torch.cat(outs))


@pytest.mark.parametrize(
    "rows",
    [lambda x: [x[i] for i in range(len(x))], lambda x: list(x.unbind(0)), list],
    ids=["index", "unbind", "iterate"],
)
def test_one_example_taken_out_of_the_batch_alone_is_told_to_keep_the_batch_dimension(rows):
    """``x[i]``, ``x.unbind(0)``, ``for xi in x``: each call of the layer sees one example,
    so "per-example gradients do not exist" was the wrong advice; the refusal says the
    example lost its batch dimension and how to keep it (``x[i : i + 1]``, or to give it back,
    ``x[i][None]``: both followed, grad1 is then each example's)."""
    model = _EachRow(rows)
    x = torch.randn(4, 3)
    with gradhooks.add_hooks(model):
        e = _raised(gradhooks.MixedExamplesError, lambda: model(x), r"'a' \(Linear\)")
    assert "one example taken out of the batch alone" in str(e)
    assert "x[i : i + 1], x[i][None] or x.split(1)" in str(e) and "do not exist" not in str(e)
    assert _untouched(model)
    for keep in (lambda x: list(x.split(1)), lambda x: [x[i][None] for i in range(len(x))]):
        kept = _EachRow(keep)
        with gradhooks.add_hooks(kept, loss_reduction="sum"):
            kept(x).sum().backward()
        for p in kept.parameters():  # (each example's own: the sum of its rows)
            assert p.grad1.shape == (4, *p.shape)
            torch.testing.assert_close(p.grad1.sum(0), p.grad)


@pytest.mark.parametrize(
    "between", [lambda x: x[0] + x[1], lambda x: x - x.mean(0)], ids=["two-added", "centred"]
)
def test_examples_combined_are_still_told_that_per_example_gradients_do_not_exist(between):
    """Where rows of several examples are combined (two examples taken out and added, a
    mean over the batch), the refusal keeps saying so."""
    model = _EachRow(lambda x: [between(x)])
    with gradhooks.add_hooks(model):
        e = _raised(gradhooks.MixedExamplesError, lambda: model(torch.randn(4, 3)))
    assert "do not exist" in str(e) and "taken out of the batch alone" not in str(e)
    assert _untouched(model)


class _Strided(nn.Module):
    """A layer given rows made by an operation the tracker does not follow (``as_strided``):
    ``rows`` of them from a batch of 4."""

    def __init__(self, rows):
        super().__init__()
        self.l, self.rows = nn.Linear(3, 2), rows

    def forward(self, x):
        return self.l(x.as_strided((self.rows, 3), (3, 1)))


def test_batch_lost_through_an_unknown_operation_also_offers_batch_dim_none():
    """A layer that sees another number of rows than the model's batch, after an operation
    gradhooks does not follow: its rows may be the examples elsewhere (``batch_dim=k``) or
    not examples at all (bags cut from a flat tensor): then ``batch_dim=None``, which gives
    one row per entry of the layer's dimension 0, as it says."""
    model = _Strided(2)
    with gradhooks.add_hooks(model):
        out = model(torch.randn(4, 6)).sum()
        e = _raised(gradhooks.BatchNotFoundError, out.backward, r"'l' \(Linear\).*as_strided")
    assert "batch_dim=k" in str(e) and "batch_dim=None" in str(e)
    assert _untouched(model)
    with gradhooks.add_hooks(model, batch_dim=None):
        model(torch.randn(4, 6)).sum().backward()
    assert model.l.weight.grad1.shape == (2, 2, 3)


class _Anil(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)


def _anil_query_loss(model, h, support, query, paused):
    """ANIL's second-order step: the head adapted on the support features by a
    ``create_graph=True`` gradient, then called with its fast weights on the query's."""
    (sx, sy), (qx, qy) = support, query
    with h.paused() if paused else torch.enable_grad():
        head = dict(model.head.named_parameters())
        loss = F.cross_entropy(model.head(model.body(sx)), sy)
        g = torch.autograd.grad(loss, list(head.values()), create_graph=True)
    fast = {n: p - 0.5 * gi for (n, p), gi in zip(head.items(), g, strict=True)}
    logits = torch.func.functional_call(model.head, fast, (model.body(qx),))
    return F.cross_entropy(logits, qy, reduction="sum")


def test_a_captured_inner_step_of_a_second_order_step_is_told_to_pause_it():
    """Support and query batches of different sizes, the inner step captured: the rows that
    clash come from the double backward, so "concatenate the batches" did not apply; the
    refusal names the double backward and says to run the inner step under ``h.paused()``,
    which gives grad1 with the query's rows."""
    model = _Anil()
    support = torch.randn(4, 3), torch.randint(0, 2, (4,))
    query = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        loss = _anil_query_loss(model, h, support, query, paused=False)
        e = _raised(gradhooks.StateError, loss.backward, r"'body\.0\.weight'")
        assert "double backward" in str(e) and "h.paused()" in str(e)
        assert "concatenate" not in str(e)
        assert _untouched(model)
        _anil_query_loss(model, h, support, query, paused=True).backward()
    assert model.head.weight.grad1.shape == (5, 2, 6)


def test_two_batches_of_different_sizes_in_one_loss_are_still_told_to_concatenate():
    model = nn.Linear(3, 2)
    with gradhooks.add_hooks(model):
        loss = model(torch.randn(4, 3)).sum() + model(torch.randn(6, 3)).sum()
        e = _raised(gradhooks.StateError, loss.backward, "batch size changed")
    assert "concatenate them into one forward" in str(e) and "double backward" not in str(e)
    assert _untouched(model)


def test_accumulated_micro_batches_of_a_loader_with_a_short_last_batch():
    """Gradient accumulation over a data loader whose last micro-batch is shorter (11 examples
    in batches of 3, two a step): the refusal says to drop the short batch and leaves the
    step's first micro-batch as it was, and with ``drop_last=True`` each accumulated step's
    grad1 is the per-example loop's."""
    from torch.utils.data import DataLoader, TensorDataset

    from gradhooks.oracle import loop_grad
    from harness import assert_untouched, model_state, wide_mlp

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(11, 3, dtype=torch.float64), torch.randint(0, 2, (11,)))

    def loss(out, y):
        return F.cross_entropy(out, y, reduction="sum")

    model = wide_mlp()
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for drop_last in (False, True):
            batches = list(DataLoader(data, batch_size=3, drop_last=drop_last))
            for i in range(0, len(batches), 2):
                model.zero_grad()
                h.clear()
                group = batches[i : i + 2]
                loss(model(group[0][0]), group[0][1]).backward()
                if len(group) == 2:
                    x1, y1 = group[1]
                    second = loss(model(x1), y1)
                    if len(x1) != len(group[0][0]):
                        before = model_state(model)
                        e = _raised(gradhooks.StateError, second.backward, "batch size changed")
                        assert "drop_last=True" in str(e) and "dataloader_drop_last" in str(e)
                        assert_untouched(model, before)
                        break
                    second.backward()
                for name, p in model.named_parameters():
                    want = sum(loop_grad(model, loss, x, y)[name] for x, y in group)
                    torch.testing.assert_close(p.grad1, want)
            else:
                assert drop_last, "the short last batch was never met"


def test_a_batch_size_finder_retries_a_smaller_batch_when_grad1_is_too_large():
    """accelerate's ``find_executable_batch_size`` tries smaller batches on an out-of-memory
    error: on gradhooks' refusal of a ``grad1`` over the limit too (nothing allocated, the
    forward not run; a limit of 5 examples' ``grad1``), and the largest batch that fits gives
    the per-example loop's ``grad1``."""
    pytest.importorskip("accelerate")
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import should_reduce_batch_size

    from gradhooks.oracle import loop_grad
    from harness import wide_mlp

    model = wide_mlp()
    numel = sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    tried, refused = [], []

    def loss(out, t):
        return F.cross_entropy(out, t, reduction="sum")

    with gradhooks.add_hooks(model, loss_reduction="sum", max_grad1_bytes=5 * numel * 8) as h:

        @find_executable_batch_size(starting_batch_size=8)
        def train(batch_size):
            tried.append(batch_size)
            model.zero_grad()
            h.clear()
            try:
                loss(model(x[:batch_size]), y[:batch_size]).backward()
            except gradhooks.Grad1TooLarge as e:
                refused.append(e)
                raise
            return batch_size

        fits = train()  # (accelerate's own schedule of smaller batches)
        assert fits == 5 and tried[0] == 8 and tried == sorted(tried, reverse=True), tried
        want = loop_grad(model, loss, x[:fits], y[:fits])
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, want[name])
    assert len(refused) == len(tried) - 1 and all(map(should_reduce_batch_size, refused))

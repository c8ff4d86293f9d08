"""Cases that once gave a number silently wrong, or an error that misled: each now gives the
number of a per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`), or stops with a
typed error that names what it refuses and leaves the model as it was.

- ``torch.func.functional_call(model, tensors, x)`` with leaf tensors of the user's in the
  parameters' slots, the hooks added again around each micro-batch's backward: ``grad1`` of the
  tensors adds up over the micro-batches as their ``.grad`` does, as a parameter's does.
- ``torch.nn.utils.clip_grad_value_`` (or any change of ``.grad``) between
  :meth:`gradhooks.DPOptimizer.backward` and its ``step``, which writes ``.grad`` afresh:
  refused, naming the parameter and the change, before anything is stepped.
- a backward stopped part-way by an error outside gradhooks (``torch.autograd.detect_anomaly``
  at a NaN), caught by the loop: the ``grad1`` it wrote for the layers it reached is taken back
  as it fails, as a refused backward's is, not left to be read as if complete.
- ``model.eval()`` (or ``train()``) between the forward and :meth:`gradhooks.Hooks.check`,
  which recomputes the examples in the mode the model is in then: the report says the mode
  changed since the captured forward, not to "check in eval mode" a model that is.
- a clipping group whose parameters are all frozen (an optimizer's ``param_groups`` with a
  frozen block): left out with its bound, as the documentation says of an empty group, so the
  other groups' bounds and the noise are those of the groups that have a gradient.
- a module without a rule (run by the fallback) that keeps, in a list of its own, a tensor
  its returned tensors are computed from (a router's logits), read by a z-loss outside the
  call: the backward is refused, under ``verify=False`` too, naming the module and the
  parameter, where the kept tensor gets a gradient besides what the call's own operations send
  it; kept only to be looked at, detached, or returned, ``grad1`` is the loop's.
- an index of the batch's top-k (columns chosen by the batch's mean activation), detached,
  copied, moved, or read into a NumPy array or a list (TimesNet's periods,
  ``topk(...).indices.detach().cpu().numpy()``) and used to pick each example's entries: each
  example's entries are chosen by all of them, as with the index itself, and the layer after
  is refused, naming the read; read and only kept to be looked at, ``grad1`` is the loop's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_untouched,
    labelled_batch,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
    wide_mlp,
)

D = torch.float64
MICRO = 3


def _clipped_mean(want: dict, max_norm: float, n: int) -> dict:
    """Each example's whole-model gradient clipped to ``max_norm``, summed, divided by ``n``."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    factor = (max_norm / norms).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", factor, g) / n for k, g in want.items()}


def _loaded(model, tensors: dict):
    """A copy of ``model`` holding ``tensors`` (detached) in its parameters' slots."""
    reference = copy.deepcopy(model)
    reference.load_state_dict({n: t.detach() for n, t in tensors.items()})
    return reference


# -- functional_call with the user's leaf tensors, hooks added around each micro-batch --------


@pytest.mark.parametrize("then", ["accumulate", "zero_grad"])
def test_functional_call_leaves_accumulate_with_hooks_added_per_micro_batch(then):
    """An ensemble member's leaf tensors through ``functional_call``, ``with add_hooks(model)``
    around each of three micro-batches' backward: each tensor's ``grad1`` is the sum of the
    micro-batches' loop gradients, and ``.grad`` its mean over the rows divided as the loss is
    (the documented rule: ``grad1`` adds up where ``.grad`` still holds what the last hooks'
    backward added). Reset between micro-batches (``t.grad = None``), each starts afresh.
    Before, ``grad1`` held only the last micro-batch's rows while ``.grad`` held the sum."""
    model = wide_mlp(out=3)
    tensors = {n: (p + 0.1).detach().requires_grad_() for n, p in model.named_parameters()}
    reference = _loaded(model, tensors)
    total = {n: torch.zeros(5, *t.shape, dtype=D) for n, t in tensors.items()}
    for k in range(MICRO):
        if then == "zero_grad":
            for t in tensors.values():
                t.grad = None
            total = {n: torch.zeros_like(s) for n, s in total.items()}
        x, y = labelled_batch(40 + k, classes=3)
        want = loop_grad(reference, F.cross_entropy, x, y)
        with gradhooks.add_hooks(model) as h:
            (
                F.cross_entropy(torch.func.functional_call(model, tensors, (x,)), y) / MICRO
            ).backward()
            held = h.accumulated
        assert held == (k + 1 if then == "accumulate" else 1), f"micro-batch {k}: {held}"
        for n, t in tensors.items():
            total[n] = total[n] + want[n] / MICRO
            assert_close(t.grad1, total[n], f"micro-batch {k}: grad1 of {n}")
            assert_close(t.grad, total[n].mean(0), f"micro-batch {k}: .grad of {n}")
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1") and p.grad is None, f"the model's own {n} was written"


# -- a change of .grad between DPOptimizer.backward and its step ------------------------------


def _clip_value(model) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)


def _add_a_plain_backward(model) -> None:
    x, y = labelled_batch(99, classes=3)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("change", [_clip_value, _add_a_plain_backward], ids=["clip", "backward"])
@pytest.mark.parametrize("reset", ["none", "zeros"], ids=["no_zero_grad", "zeros"])
def test_grad_changed_between_dp_backward_and_step_is_refused(change, reset):
    """A loop ported from plain training clips ``.grad`` by value between the backward and the
    step. :meth:`DPOptimizer.step` writes ``.grad`` afresh (the noised clipped mean), so a
    change made there would be lost without a word: ``.grad`` still holding the last step's
    gradient (no ``zero_grad`` in the loop) or zeros (``set_to_none=False``), the step is
    refused with a :class:`gradhooks.StateError` naming the parameter and its shape, nothing
    stepped. With ``.grad`` reset, the step then gives the loop's clipped mean."""
    model = wide_mlp(out=3)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            inner, h, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=5
        )
        for step in range(2):
            if reset == "zeros":
                opt.zero_grad(set_to_none=False)
            x, y = labelled_batch(50 + step, classes=3)
            want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            if step == 0:
                assert opt.step() is True
                continue
            change(model)
            before = model_state(model)
            err = raised(
                gradhooks.StateError,
                ["DPOptimizer.step", "'0.weight' (6, 3)", "clip_grad_value_",
                 "register_step_pre_hook"],
                opt.step,
            )  # fmt: skip
            assert "1 physical batch(es)" in str(err), str(err)
            assert_untouched(model, before)
            model.zero_grad()  # (the change let go of: the step goes on)
            stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert opt.step() is True
            for n, g in _clipped_mean(want, 0.5, 5).items():
                p = model.get_parameter(n)
                assert_close(p.grad, g, f"step {step}: .grad of {n}")
                assert_close(p.detach(), stepped[n] - 0.5 * g, f"step {step}: {n}")


# -- a backward stopped part-way by an error outside gradhooks --------------------------------


class _Rooted(nn.Module):
    """A body, the square root of its output's magnitude, a head; with ``guarded=False`` the
    square root written as ``where(h > 0, sqrt(h), 0)``: the forward is finite, the backward of
    the square root gives NaN at a negative entry (``0 / sqrt(h)``), after the head's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = wide_mlp(out=6)
        self.head = nn.Linear(6, 3).to(D)

    def forward(self, x, guarded: bool = True):
        h = self.body(x)
        return self.head(torch.sqrt(h.abs() + 1e-3) if guarded else torch.where(h > 0, h.sqrt(), 0))


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.filterwarnings("ignore:Error detected in")
@pytest.mark.parametrize("then", ["accumulate", "zero_grad"])
def test_a_backward_stopped_by_detect_anomaly_leaves_no_partial_grad1(then):
    """Under ``detect_anomaly`` a backward stops at ``SqrtBackward0``, after the head's hooks
    ran; the loop catches torch's ``RuntimeError``. Read at once, ``grad1`` holds no row of the
    stopped backward: accumulating, every parameter's is the last complete backward's (the
    loop's of the batch before, ``accumulated`` 1); after ``zero_grad``, the head's, which the
    stopped backward had begun to replace, is gone. Before, the head's held the stopped
    backward's rows until the next forward, beside the body's of the batch before."""
    model = _Rooted()
    with gradhooks.add_hooks(model) as h, torch.autograd.detect_anomaly(check_nan=True):
        x, y = labelled_batch(60, classes=3)
        first = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, first[n], f"first: {n}")
        x, y = labelled_batch(61, classes=3)
        assert (model.body(x) < 0).any()  # (a NaN in the backward)
        if then == "zero_grad":
            model.zero_grad()
        loss = F.cross_entropy(model(x, guarded=False), y)
        with pytest.raises(RuntimeError, match="SqrtBackward0"):
            loss.backward()
        if then == "accumulate":
            assert h.accumulated == 1
            for n, p in model.named_parameters():
                assert_close(p.grad1, first[n], f"after the stopped backward: {n}")
        else:
            for n, p in model.head.named_parameters():
                assert not hasattr(p, "grad1"), f"head.{n} keeps the stopped backward's rows"


# -- the mode switched between the captured forward and check() -------------------------------


@pytest.mark.parametrize("then", ["train", "eval"])
def test_check_after_the_mode_switched_names_the_switch(then):
    """A model with dropout, its forward in ``then`` mode, switched to the other before the
    backward (a loop that evaluates in between, or computes the loss in eval mode and forgets
    nothing): ``grad1`` is the gradient of the forward as it ran (in eval mode, the loop's),
    and ``check(loss_fn, x, y)``, which recomputes the first examples in the mode the model is
    in now, fails saying that the model was in ``then`` mode at the captured forward and is in
    the other now. Before, it said the model may be random and to "check in eval mode", also
    to a model in eval mode. A model without dropout or batch norm passes the same check."""
    x, y = labelled_batch(80, n=6, classes=3)
    other = "eval" if then == "train" else "train"
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(D)
    model.train(then == "train")
    want = loop_grad(copy.deepcopy(model).eval(), F.cross_entropy, x, y)
    with gradhooks.add_hooks(model) as h:
        loss = F.cross_entropy(model(x), y)
        model.train(other == "train")
        loss.backward()
        if then == "eval":
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{n} (the forward in eval mode)")
        err = raised(
            gradhooks.CheckFailedError,
            [f"in {then} mode at the captured forward", f"in {other} mode now",
             f"model.{then}()"],
            lambda: h.check(F.cross_entropy, x, y),
        )  # fmt: skip
        assert "check in eval mode" not in str(err), str(err)
    plain = wide_mlp(out=3)
    with gradhooks.add_hooks(plain) as h:
        loss = F.cross_entropy(plain(x), y)
        plain.eval()
        loss.backward()
        assert h.check(F.cross_entropy, x, y).ok


# -- a clipping group whose parameters are all frozen ------------------------------------------


def _three_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)
    ).to(D)
    model[2].requires_grad_(False)
    return model


def _group_clipped_mean(want: dict, groups: list[list[str]], bounds: list[float]) -> dict:
    """Each example's gradient of each group clipped to that group's bound, summed over the
    batch, divided by its size."""
    out = {}
    for names, bound in zip(groups, bounds, strict=True):
        norms = torch.stack([want[n].flatten(1).pow(2).sum(1) for n in names]).sum(0).sqrt()
        factor = (bound / norms).clamp(max=1.0)
        for n in names:
            out[n] = torch.einsum("b,b...->...", factor, want[n]) / want[n].shape[0]
    return out


@pytest.mark.filterwarnings("ignore:gradhooks.dp_sgd_step. the generator starts")
@pytest.mark.parametrize("bounds", ["one", "per_group"])
def test_a_frozen_clipping_group_counts_for_nothing(bounds):
    """Three blocks, the middle one frozen, grouped as an optimizer's ``param_groups``: the DP
    step (no noise) is the float64 loop's gradients clipped group by group to the bounds of the
    two trainable groups (``C/√2`` each for one float ``C``; the given bounds of those groups
    for one per group), divided by the batch; with noise, the same step as with the frozen
    group left out (and its bound), draw for draw. Before, one ``C`` was split ``C/√3`` (a
    clip tighter than asked), and a frozen group's bound added to the noise's total bound."""
    model = _three_blocks()
    names = [[f"{k}.weight", f"{k}.bias"] for k in (0, 2, 4)]
    live = [names[0], names[2]]
    given = 0.5 if bounds == "one" else [0.3, 0.7, 0.4]
    left = 0.5 if bounds == "one" else [0.3, 0.4]
    per_group = [0.5 / 2**0.5] * 2 if bounds == "one" else left
    x, y = labelled_batch(90, n=6, classes=3)
    want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
    assert set(want) == {n for g in live for n in g}
    clipped = _group_clipped_mean(want, live, per_group)
    assert any((clipped[n] - want[n].mean(0)).abs().max() > 1e-3 for n in clipped)  # (clipped)
    grads = {}
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for what, groups, bound, sigma in [
            ("frozen group in, no noise", names, given, 0.0),
            ("frozen group in", names, given, 1.0),
            ("frozen group out", live, left, 1.0),
        ]:
            model.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, losses, max_norm=bound, noise_multiplier=sigma, method="bookkeeping",
                generator=torch.Generator().manual_seed(3), clipping_groups=groups,
            )  # fmt: skip
            grads[what] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
        for what, groups, bound in [("in", names, given), ("out", live, left)]:
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                h, max_grad_norm=bound, noise_multiplier=1.0, expected_batch_size=6,
                generator=torch.Generator().manual_seed(3), clipping_groups=groups,
            )  # fmt: skip
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            grads[f"DPOptimizer, frozen group {what}"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
            opt.zero_grad()
    for n, g in clipped.items():
        assert_close(grads["frozen group in, no noise"][n], g, f"clipped: {n}")
        assert_close(grads["frozen group in"][n], grads["frozen group out"][n], f"noised: {n}")
        assert_close(
            grads["DPOptimizer, frozen group in"][n],
            grads["DPOptimizer, frozen group out"][n],
            f"DPOptimizer: {n}",
        )


# -- a fallback call's tensor kept on the module, on the way to its outputs, read aside -------


class KeepsLogits(nn.Module):
    """A router without a rule that keeps its logits in a list (for a z-loss read outside its
    call) and returns their softmax. ``keep``: ``"graph"`` as computed; ``"detached"``;
    ``"returned"``, kept and also returned (Mixtral's ``(weights, logits)``), the z-loss
    reading the kept ones; ``"returned_only"``, returned, not kept, and the z-loss reading
    the returned ones."""

    def __init__(self, keep: str, n: int = 4, experts: int = 3):
        super().__init__()
        self.keep, self.logits = keep, []
        self.w = nn.Parameter(torch.randn(n, experts) / 2)

    def forward(self, x):
        logits = x @ self.w
        if self.keep != "returned_only":
            self.logits.append(logits.detach() if self.keep == "detached" else logits)
        if self.keep.startswith("returned"):
            return logits.softmax(-1), logits
        return logits.softmax(-1)


class Routed(nn.Module):
    def __init__(self, keep: str):
        super().__init__()
        self.router, self.head = KeepsLogits(keep), nn.Linear(3, 2)

    def forward(self, x):
        out = self.router(x)
        if self.router.keep == "returned_only":
            return self.head(out[0]), out[1]
        return self.head(out[0] if isinstance(out, tuple) else out)


def _z_loss(model):
    def loss(out, target=None):
        out, logits = out if isinstance(out, tuple) else (out, model.router.logits.pop())
        return out.pow(2).sum() + torch.logsumexp(logits, -1).pow(2).sum()

    return loss


@pytest.mark.parametrize("keep", ["graph", "returned", "detached", "returned_only"])
def test_fallback_tensor_kept_on_the_way_and_read_aside(keep):
    """The router's logits, kept in its list and read by a z-loss after the forward, are on
    the way to its returned softmax (or are a returned tensor, which the engine hooks through
    a node of its own, the call returning two): the gradient reaching them holds the
    softmax's and the z-loss's, which the fallback's recomputation from the returned tensors
    leaves out. The backward is refused, naming the module and the parameter, under
    ``verify=False`` too (before: ``grad1`` of ``router.w`` silently off by the z-loss's
    share there, the run-time check alone refusing it, at the backwards it checks). Kept
    detached, or returned and read from there, ``grad1`` is the loop's, under either."""
    torch.manual_seed(0)
    model = Routed(keep).double()
    x = torch.randn(5, 4, dtype=D)
    loss = _z_loss(model)
    want = loop_grad(model, loss, x)
    for verify in (True, False):
        model.zero_grad()
        with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
            run = lambda: loss(model(x)).backward()  # noqa: E731
            if keep in ("graph", "returned"):
                says = ["'router' (KeepsLogits)", "'w'", "besides the one that flowed back"]
                raised(gradhooks.UnsupportedError, says, run)
                assert not hasattr(model.router.w, "grad1"), f"verify={verify}: grad1 written"
                continue
            run()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"verify={verify}: grad1 of {n}")


class PicksByTheBatch(nn.Module):
    """Two columns of each example's activations picked by the batch's mean activation's
    top-2 (``how`` the index goes from the top-k to the pick)."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 6), nn.Linear(2, 1), how
        self.seen: list = []

    def forward(self, x):
        h = self.a(x)
        idx = h.mean(0).topk(2).indices
        if self.how == "looked at":
            self.seen.append(idx.detach().cpu().numpy())
            return self.b(h[:, :2])
        idx = {
            "detach": lambda: idx.detach(),
            "clone": lambda: idx.clone(),
            "add": lambda: idx + 0,
            "numpy": lambda: idx.detach().cpu().numpy(),
            "tolist": lambda: idx.tolist(),
        }[self.how]()
        return self.b(h[:, idx])


@pytest.mark.parametrize("how", ["detach", "clone", "add", "numpy", "tolist"])
def test_an_index_chosen_by_the_batch_is_refused_however_it_is_carried(how):
    """Once, ``h[:, idx.detach()]`` (or a copy, or a NumPy array or list of it) gave a
    ``grad1`` off the loop's by 1.9: a tensor made from an index computed across the batch
    was taken for one of unknown layout, and what was read into Python was not followed."""
    torch.manual_seed(0)
    model = PicksByTheBatch(how).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(gradhooks.MixedExamplesError, match="'b' \\(Linear\\)"):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            model(x).sum().backward()
    assert all(getattr(p, "grad1", None) is None for p in model.parameters())


def test_an_index_chosen_by_the_batch_only_looked_at_matches():
    torch.manual_seed(0)
    model = PicksByTheBatch("looked at").double()
    x = torch.randn(3, 4, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).sum().backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], name)

"""Losses computed inside the forward that couple the examples after a reduction over the
batch (gradhooks.tracking.couplings): a mixture of experts' load-balancing loss over every token
of the batch is refused where a backward reaches it, naming the router; its working cousins (the
same loss per example, a batch mean of per-example terms, a loss divided by the batch's token
count, the term computed but not backpropagated) match the per-example loop in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1

D = torch.float64
EXPERTS, TOP = 3, 2


class Routed(nn.Module):
    """Tokens ``[batch, tokens, 4]`` through a soft mixture of experts (each token's top-2
    experts, weighted by the router's probabilities) and a classifier; the forward returns the
    logits and a loss of ``y`` made as a Hugging Face model makes it: a cross-entropy summed over
    the tokens, plus the auxiliary term ``aux``:

    - ``"batch"``: Switch Transformer's load-balancing loss over every token of the batch,
      ``E · Σ_e f_e · P_e`` (``f_e`` the share of the batch's tokens routed to expert ``e``,
      counted, ``P_e`` the router's mean probability), as Mixtral's;
    - ``"example"``: the same loss over each example's own tokens, summed over the examples
      (Switch Transformers' per-group form);
    - ``"z"``: the router's z-loss, ``logsumexp(logits)²`` averaged over every token;
    - ``"count"``: no term; the cross-entropy divided by the batch's count of real tokens
      (``mask.sum()``, a number common to every example), unless ``count`` gives it
      (one entry per example, each the batch's count: the loop's);
    - ``"product"``: the product of two reductions over the batch with a gradient;
    - ``"square"``: the squares of the router's mean probabilities over the batch, summed;
    - ``None``: none.
    """

    def __init__(self, aux):
        super().__init__()
        torch.manual_seed(0)
        self.aux = aux
        self.gate = nn.Linear(4, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(EXPERTS))
        self.head = nn.Linear(4, 3)

    def forward(self, x, y, mask, count=None):
        b, t, d = x.shape
        h = x.reshape(-1, d)
        logits_r = self.gate(h)
        probs = logits_r.softmax(-1)
        weights, chosen = probs.topk(TOP, -1)
        routed = F.one_hot(chosen, EXPERTS).to(h.dtype)  # [tokens, top, experts]
        share = (weights[..., None] * routed).sum(1)  # [tokens, experts]
        out = sum(share[:, e, None] * expert(h) for e, expert in enumerate(self.experts))
        logits = self.head(torch.tanh(out)).view(b, t, -1)
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum()
        if self.aux == "batch":
            f = routed.sum(1).mean(0)  # [experts]: no gradient
            loss = loss + EXPERTS * (f * probs.mean(0)).sum()
        elif self.aux == "example":
            f = routed.sum(1).view(b, t, -1).mean(1)  # [batch, experts]
            loss = loss + EXPERTS * (f * probs.view(b, t, -1).mean(1)).sum()
        elif self.aux == "z":
            loss = loss + 0.1 * (logits_r.logsumexp(-1) ** 2).mean() * b
        elif self.aux == "count":
            loss = loss / (mask.sum() if count is None else count.sum())
        elif self.aux == "product":
            loss = loss + (probs.mean(0) * logits.mean((0, 1))[:EXPERTS]).sum()
        elif self.aux == "square":
            loss = loss + (probs.mean(0) ** 2).sum()
        return logits, loss


def batch(n=4, t=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, t, 4, dtype=D, generator=g)
    y = torch.randint(0, 3, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=D)
    mask[1, 3:] = 0  # (padding)
    mask[2, 4:] = 0
    return x, y, mask


def own_loss(out):
    return out[1]


@pytest.mark.parametrize("verify", [True, False])
def test_load_balancing_loss_over_the_batch_is_refused_naming_the_router(verify):
    """``E · Σ_e f_e · P_e`` over every token of the batch: ``f_e`` (counted, no gradient)
    weights each expert's probability by the whole batch's routing, so no example has a loss
    of its own; before, grad1 of the router was each example's share, silently (in the
    Hugging Face sweep, 16 mixtures of experts 0.9% to 116% off the loop). Refused at the
    backward, naming the router and its weight, nothing written."""
    model = Routed("batch").to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
        _, loss = model(*batch())
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'gate' \(Linear\).*gate\.weight"
                           r".*couples the examples.*statistic of the whole batch"):  # fmt: skip
            loss.backward()
    assert all(not hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("aux", ["product", "square"])
def test_products_of_reductions_over_the_batch_are_refused(aux):
    model = Routed(aux).to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _, loss = model(*batch())
        with pytest.raises(gradhooks.MixedExamplesError, match="reductions? over the batch"):
            loss.backward()
    assert all(not hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("aux", [None, "example", "z"])
def test_auxiliary_losses_that_sum_per_example_terms_match_the_loop(aux):
    """The load-balancing loss per example and the z-loss averaged over the batch (a sum of
    per-example terms over a number of examples) are not refused: grad1 is the loop's."""
    model = Routed(aux).to(D)
    inputs = batch()
    want = loop_grad(model, own_loss, inputs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(*inputs)[1].backward()
    assert_grad1(model, want, aux or "no term")


def test_a_loss_divided_by_the_batch_token_count_is_each_example_s_share():
    """The loss divided by the batch's count of real tokens, computed in the forward (Hugging
    Face's ``num_items_in_batch``): a number common to every example, so grad1 is each
    example's loss divided by it, as the loop gives with that count."""
    model = Routed("count").to(D)
    x, y, mask = inputs = batch()
    count = mask.sum()
    want = loop_grad(
        model, own_loss, (x, y, mask, count.expand(x.shape[0]).clone())
    )  # (the loop divides each example's loss by the batch's count)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(*inputs)[1].backward()
    assert_grad1(model, want, "count")


def test_a_coupled_term_computed_but_not_backpropagated_is_not_refused():
    """The load-balancing loss computed in the forward (``output_router_logits=True``) while
    the loss backpropagated is the logits' own: grad1 matches the loop; a backward through
    the term under ``h.paused()`` writes nothing and is not refused."""
    model = Routed("batch").to(D)
    x, y, mask = inputs = batch()

    def logits_loss(out, target):
        return F.cross_entropy(out[0].flatten(0, 1), target.flatten(), reduction="sum")

    want = loop_grad(model, logits_loss, inputs, target=y)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        logits, loss = model(*inputs)
        logits_loss((logits, None), y).backward(retain_graph=True)
        assert_grad1(model, want, "logits' loss")
        with h.paused():
            loss.backward()
        assert_grad1(model, want, "after a paused backward")


def test_a_backward_to_the_input_alone_through_the_coupled_term_is_not_refused():
    """``torch.autograd.grad(loss, x)`` (saliency) through the load-balancing loss computes no
    parameter's gradient: no grad1, no refusal; the input's gradient is autograd's."""
    model = Routed("batch").to(D)
    x, y, mask = batch()
    x.requires_grad_()
    _, loss = model(x, y, mask)
    (want,) = torch.autograd.grad(loss, x, retain_graph=True)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _, loss = model(x, y, mask)
        (got,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(got, want)
    assert all(not hasattr(p, "grad1") for p in model.parameters())


# -- losses that take the examples together as one matrix ---------------------------------------

F_IN = 4


class LossInside(nn.Module):
    """A Linear, then a loss of its outputs ``o`` ``[batch, 4]`` computed in the forward."""

    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(F_IN, F_IN).double()
        self.loss = loss

    def forward(self, x):
        return self.loss(self.lin(x))


_EYE = torch.eye(4, dtype=D)
MATRIX_LOSSES = {
    "det_of_the_gram_matrix": lambda o: torch.det(o @ o.T),
    "logdet_of_the_gram_matrix": lambda o: torch.logdet(o @ o.T + _EYE),
    "trace_of_a_softmax_of_the_gram_matrix": lambda o: torch.trace((o @ o.T).softmax(1)),
    "condition_number": lambda o: torch.linalg.cond(o),
    "spectral_norm": lambda o: torch.linalg.matrix_norm(o, 2),
    "log_of_the_mean_probabilities": lambda o: o.softmax(1).mean(0).log().sum(),
}


@pytest.mark.parametrize("name", sorted(MATRIX_LOSSES))
def test_a_loss_of_the_examples_as_one_matrix_is_refused(name):
    """Each is no sum of per-example losses, nor a function of one: grad1 was each example's
    share of the batch's gradient, silently (the per-example loop's gradients differ)."""
    model = LossInside(MATRIX_LOSSES[name])
    x = torch.randn(4, F_IN, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.errors.MixedExamplesError) as caught:
            model(x).backward()
        assert getattr(model.lin.weight, "grad1", None) is None
    assert "'lin.bias'" in str(caught.value)


@pytest.mark.parametrize(
    "loss",
    [
        lambda o: torch.trace(o @ o.T),  # (each example's own diagonal entry: a sum)
        lambda o: (o**2).sum() * 3 + 1,
        lambda o: torch.stack([torch.det(r.view(2, 2)) for r in o]).sum(),  # (one example each)
        lambda o: torch.det(o.view(-1, 2, 2)).sum(),  # (a matrix per example)
    ],
    ids=["trace_of_the_gram_matrix", "affine_sum", "det_of_each_example_alone",
         "det_of_each_example"],
)  # fmt: skip
def test_losses_that_sum_per_example_terms_match_the_loop(loss):
    model = LossInside(loss)
    x = torch.randn(4, F_IN, dtype=D)
    want = loop_grad(model, lambda out: out, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).backward()
        assert_grad1(model, want, "a sum of per-example terms")

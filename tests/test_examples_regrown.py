"""An example taken out of the batch alone and given its batch dimension back before a layer:
``x[i].unsqueeze(0)``, ``x[i][None]``, ``x[i].view(1, -1)``, ``for xi in x: f(xi[None])``.

This is how per-image code is written (Segment Anything's ``Sam.forward`` runs its mask decoder
on ``curr_embedding.unsqueeze(0)`` for each image; detection heads and set-prediction losses
loop over images the same way). Each such tensor holds that one example as a batch of one, as
``x[i : i + 1]`` does, and gradhooks follows it as it follows the slice: every layer on it is
compared here with the float64 per-example loop, in a training loop and under bfloat16
autocast. What combines two examples, or an example with the batch, is still refused, the
model as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1, assert_untouched, labelled_batch, model_state, one_thread, raised  # noqa: F401

D = torch.float64
REGROWN = {
    "slice": lambda e, i: e[i : i + 1],  # (the reference: followed before)
    "unsqueeze": lambda e, i: e[i].unsqueeze(0),
    "none": lambda e, i: e[i][None],
    "view": lambda e, i: e[i].view(1, -1),
    "reshape": lambda e, i: e[i].reshape(1, *e[i].shape),
    "after-f": lambda e, i: torch.tanh(e[i] * 2).unsqueeze(0),  # (computed from it alone)
}


class PerExample(nn.Module):
    """An encoder over the batch, then a head run on each example in turn, given back its batch
    dimension by ``regrow``; the heads' outputs joined by ``torch.cat``, or returned as a list
    (``joined=False``) for a loss per example."""

    def __init__(self, regrow: str, joined: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(3, 6), nn.Linear(6, 2)
        self.regrow, self.joined = REGROWN[regrow], joined

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        outs = [self.head(self.regrow(e, i)) for i in range(e.shape[0])]
        return torch.cat(outs) if self.joined else outs


def _batch4(step):
    return labelled_batch(step, n=4)


def _sum_ce(out, y):
    if isinstance(out, list):
        return sum(F.cross_entropy(o, y[i : i + 1], reduction="sum") for i, o in enumerate(out))
    return F.cross_entropy(out, y, reduction="sum")


def trains_as_the_loop(model: nn.Module, data, steps: int, what: str) -> None:
    """``steps`` SGD steps on ``data(step)``, ``zero_grad`` and ``h.clear()`` between: each
    step's ``grad1`` and norms are the float64 loop's, and the sum of its rows is ``.grad``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for step in range(steps):
            x, y = data(step)
            want = loop_grad(copy.deepcopy(model), _sum_ce, x, y)
            opt.zero_grad()
            h.clear()
            _sum_ce(model(x), y).backward()
            assert_grad1(model, want, f"{what}, step {step}")
            torch.testing.assert_close(h.norms(), flat_norms(want))
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1.sum(0), p.grad, msg=n)
            opt.step()


@pytest.mark.parametrize("regrow", list(REGROWN))
@pytest.mark.parametrize("joined", [True, False], ids=["cat", "list"])
def test_a_head_on_each_example_regrown_trains_as_the_loop(regrow, joined):
    """Three SGD steps, ``zero_grad`` between: each step's ``grad1`` is the float64 loop's,
    and the sum of its rows is autograd's ``.grad``."""
    trains_as_the_loop(PerExample(regrow, joined).to(D), _batch4, 3, regrow)


class Sequences(nn.Module):
    """Per sequence, self-attention on ``x[i][None]`` (``[1, T, F]``), batch-first, and a head
    on its mean over time: Segment Anything's decoder loop in miniature."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 6)
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        e = self.enc(x)
        outs = []
        for ei in e:  # (iteration: unbind, one example each)
            q = ei[None]
            outs.append(self.head(self.att(q, q, q, need_weights=False)[0].mean(1)))
        return torch.cat(outs)


def _sequences(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 5, 4, generator=g, dtype=D), torch.randint(3, (3,), generator=g)


def test_attention_on_each_sequence_regrown_matches_the_loop_and_its_norms():
    model = Sequences().to(D)
    x, y = _sequences(0)
    want = loop_grad(copy.deepcopy(model), _sum_ce, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        _sum_ce(model(x), y).backward()
        assert_grad1(model, want, "attention per sequence")
        norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
        torch.testing.assert_close(h.norms(), norms)


def test_dp_step_of_a_head_on_each_example_regrown_is_the_loops_clipped_sum():
    """The book-keeping DP step (no noise): ``.grad`` is the loop's per-example gradients, each
    clipped to 1, averaged."""
    model = PerExample("unsqueeze").to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(2):
            x, y = labelled_batch(step, n=4)
            want = loop_grad(copy.deepcopy(model), _sum_ce, x, y)
            flat = torch.cat([g.flatten(1) for g in want.values()], 1)
            factors = (1.0 / flat.norm(dim=1)).clamp(max=1.0)
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
            for n, p in model.named_parameters():
                expected = torch.einsum("b,b...->...", factors, want[n]) / 4
                torch.testing.assert_close(p.grad, expected, msg=n)
            opt.step()
            h.clear()


def test_under_bf16_autocast_the_rows_sum_to_autograds_gradient():
    model = PerExample("none")
    x, y = labelled_batch(0, n=4)
    x = x.float()
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        _sum_ce(out.float(), y).backward()
        for n, p in model.named_parameters():
            assert p.grad1.dtype == torch.float32
            torch.testing.assert_close(p.grad1.sum(0), p.grad, rtol=2e-2, atol=2e-2, msg=n)
        h.clear()
    ref = loop_grad(copy.deepcopy(model).double(), _sum_ce, x.double(), y)
    for n, p in model.named_parameters():
        scale = ref[n].abs().max()
        assert (p.grad1.double() - ref[n]).abs().max() <= 5e-2 * scale, n


class Combined(nn.Module):
    """A head on two examples added (``mix``), or on one example plus the batch's mean
    (``batch-mean``), each regrown: every output depends on more than one example."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.how = nn.Linear(3, 6), nn.Linear(6, 2), how

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        outs = []
        for i in range(e.shape[0]):
            other = e[(i + 1) % e.shape[0]][None] if self.how == "mix" else e.mean(0)[None]
            outs.append(self.head(e[i].unsqueeze(0) + other))
        return torch.cat(outs)


@pytest.mark.parametrize("how", ["mix", "batch-mean"])
def test_an_example_regrown_and_combined_with_another_is_refused(how):
    model = Combined(how).to(D)
    x, y = labelled_batch(0, n=4)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        before = model_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["'head' (Linear)", "computed across the examples"],
            lambda: _sum_ce(model(x), y).backward(),
        )
        assert_untouched(model, before)


class Repeated(nn.Module):
    """Rows picked from the batch (one example, sliced or regrown) repeated along the rows (``repeat_interleave``, as Segment Anything's decoder repeats its
    image for each prompt, or ``expand`` of one row), weighted per copy, into a head; a list
    of outputs, one per pick."""

    def __init__(self, pick: str, repeat: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(3, 6), nn.Linear(6, 2)
        self.pick, self.repeat = pick, repeat

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        outs = []
        for i in range(e.shape[0]):
            r = REGROWN[self.pick](e, i)
            if self.repeat == "repeat_interleave":
                r = r.repeat_interleave(2, dim=0)
            else:
                r = r.expand(2, -1)
            w = torch.linspace(0.5, 1.5, r.shape[0], dtype=r.dtype)[:, None]
            outs.append(self.head(r * w))
        return outs


def _repeated_loss(outs, y):
    """Each example's copies' cross-entropies against its label."""
    total = 0
    for i, o in enumerate(outs):
        total = total + F.cross_entropy(o, y[i].repeat(o.shape[0]), reduction="sum")
    return total


@pytest.mark.parametrize(
    "pick, repeat",
    [
        ("slice", "repeat_interleave"),
        ("unsqueeze", "repeat_interleave"),
        ("slice", "expand"),
        ("none", "expand"),
    ],
)
def test_picked_rows_repeated_into_a_layer_match_the_loop(pick, repeat):
    model = Repeated(pick, repeat).to(D)
    loss = _repeated_loss
    x, y = labelled_batch(1, n=4)
    want = loop_grad(copy.deepcopy(model), loss, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        loss(model(x), y).backward()
        assert_grad1(model, want, f"{pick}, {repeat}")
        torch.testing.assert_close(h.norms(), flat_norms(want))


def flat_norms(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)


class ChannelNorm(nn.Module):
    """Segment Anything's ``LayerNorm2d``: a norm over the channels of ``[N, C, H, W]`` with
    its own weight and bias, a module without a rule (the ``torch.func`` fallback's)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels) + 0.1 * torch.randn(channels))
        self.bias = nn.Parameter(0.1 * torch.randn(channels))

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class PerImage(nn.Module):
    """A convolution over the batch, then per image (``pick``) a module without a rule and a
    head."""

    def __init__(self, pick: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm = nn.Conv2d(2, 3, 3, padding=1), ChannelNorm(3)
        self.head, self.pick = nn.Linear(3, 2), pick

    def forward(self, x):
        e = self.conv(x)
        outs = []
        for i in range(e.shape[0]):
            h = torch.tanh(self.norm(REGROWN[self.pick](e, i))).mean((2, 3))  # [1, 3]
            outs.append(self.head(h))
        return torch.cat(outs)


def _images(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 2, 4, 4, generator=g, dtype=D), torch.randint(2, (3,), generator=g)


@pytest.mark.parametrize("pick", ["slice", "unsqueeze", "none"])
def test_a_module_without_a_rule_on_each_image_trains_as_the_loop(pick):
    """The fallback recomputes such a call whole, as that image's own: two SGD steps, each
    step's ``grad1`` and norms against the float64 loop."""
    trains_as_the_loop(PerImage(pick).to(D), _images, 2, pick)


class Copies(nn.Module):
    """Per example, its rows repeated (as Segment Anything's decoder repeats an image per
    prompt) into a module without a rule that mixes them: each row scaled by a softmax over
    the rows; then their mean (``keepdim``) into a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.mix = RowsScaled(4)

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        outs = []
        for i in range(e.shape[0]):
            copies = e[i].unsqueeze(0).repeat_interleave(3, dim=0) * torch.tensor(
                [[1.0], [0.5], [-1.0]], dtype=e.dtype
            )
            outs.append(self.head(self.mix(copies).mean(0, keepdim=True)))
        return torch.cat(outs)


class RowsScaled(nn.Module):
    """A module without a rule whose rows are not independent: each row scaled by a softmax
    over the rows, through a weight of its own."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * torch.softmax((x * self.weight).sum(-1), 0)[:, None]


def test_a_module_without_a_rule_that_mixes_one_examples_rows_matches_the_loop():
    """Every row the module is given is one example's, and it mixes them: the fallback
    recomputes the call whole, as that example's, not row by row; the softmax and the mean
    over one example's rows are that example's alone."""
    model = Copies().to(D)
    x, y = labelled_batch(2, n=4)
    want = loop_grad(copy.deepcopy(model), _sum_ce, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        _sum_ce(model(x), y).backward()
        assert_grad1(model, want, "one example's rows mixed")
        torch.testing.assert_close(h.norms(), flat_norms(want))


class TwoImages(nn.Module):
    """The module without a rule given the rows of the images whose first feature is positive
    (a mask of each row's own, as a router's), written back into the batch: not one example's
    rows, but each row one example's, and its weight and bias meet them row by row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.head = (
            nn.Conv2d(2, 3, 3, padding=1),
            ChannelNorm(3),
            nn.Linear(3, 2),
        )

    def forward(self, x):
        e = self.conv(x)
        keep = e[:, 0, 0, 0] > 0.4
        z = e.mean((2, 3)).index_put((keep,), self.norm(e[keep]).mean((2, 3)))
        return self.head(z)


def test_a_module_without_a_rule_on_two_examples_rows_trains_as_the_loop():
    """Once refused (the fallback cannot recompute two examples' rows whole): each row's
    share of the norm's weight and bias goes to its example, as in the float64 loop."""
    model = TwoImages().to(D)
    x, _ = _images(0)
    with torch.no_grad():
        assert int((model.conv(x)[:, 0, 0, 0] > 0.4).sum()) == 2  # (the case meant)
    trains_as_the_loop(model, _images, 2, "two images' rows")


class AcrossPicked(nn.Module):
    """Rows of two examples picked by a mask of their own, then a softmax (or a mean) over
    those rows: the examples mixed, whatever picked them."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.how = nn.Linear(3, 4), nn.Linear(4, 2), how

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        picked = e[e[:, 0] > -0.3]
        if self.how == "softmax":
            mixed = picked * torch.softmax(picked.sum(-1), 0)[:, None]
        else:
            mixed = picked.mean(0, keepdim=True).expand_as(picked)
        return self.head(mixed)


@pytest.mark.parametrize("how", ["softmax", "mean"])
def test_rows_of_several_examples_combined_are_still_refused(how):
    model = AcrossPicked(how).to(D)
    x, _ = labelled_batch(2, n=4)
    with torch.no_grad():
        assert int((torch.tanh(model.enc(x))[:, 0] > -0.3).sum()) == 2  # (the case meant)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        before = model_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["'head' (Linear)"],
            lambda: model(x).pow(2).sum().backward(),
        )
        assert_untouched(model, before)


DROPPED = {
    "index": lambda h: h[0],
    "select": lambda h: h.select(0, 0),
    "mean": lambda h: h.mean(0),
    "sum-of-copies": lambda h: h.repeat_interleave(2, dim=0).sum(0),
    "squeeze": lambda h: h.squeeze(0),
    "flatten": lambda h: h.flatten(),
    "view": lambda h: h.view(-1),
}


class Dropped(nn.Module):
    """Per example, an encoder on its slice ``x[i : i + 1]``, the batch dimension of one then
    dropped (``drop``), the results stacked into a head: a loop over the batch written with
    slices."""

    def __init__(self, drop: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.drop = nn.Linear(3, 4), nn.Linear(4, 2), DROPPED[drop]

    def forward(self, x):
        return self.head(torch.stack([self.drop(torch.tanh(self.enc(x[i : i + 1])))
                                      for i in range(x.shape[0])]))  # fmt: skip


@pytest.mark.parametrize("drop", list(DROPPED))
def test_one_examples_rows_dropped_then_stacked_trains_as_the_loop(drop):
    trains_as_the_loop(Dropped(drop).to(D), _batch4, 2, drop)


# -- a parameter added into one example's rows: Segment Anything's prompt encoder ----------------


def _corners(c, w, labels):
    c[:, 0, :] += w[0]
    c[:, 1, :] += w[1]
    return c


def _labelled(c, w, labels):
    c[labels == 1] += w[1]
    return c


ADDED = {
    # _embed_boxes: each corner's embedding added in place into its rows of one image's boxes
    "in-place-slice": _corners,
    # the same out of place
    "out-of-place": lambda c, w, labels: c + w,
    # _embed_points: the embedding of each point's label added where the labels say
    "by-label-mask": _labelled,
}


class Prompts(nn.Module):
    """An image encoder on the batch, then, image by image as ``Sam.forward`` runs it, a
    prompt encoder on that image's points (``points[i][None]``, ``[1, N, 2]``) whose learned
    corner or label embeddings (``point_embeddings[k].weight``, used outside their module's
    call) are added into the prompt's rows, and a head on the image with its prompt
    (segment_anything/modeling/prompt_encoder.py, ``_embed_boxes`` and ``_embed_points``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(3, 4)
        self.coords = nn.Linear(2, 4)
        self.point_embeddings = nn.ModuleList([nn.Embedding(1, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)
        self.add = ADDED[how]

    def forward(self, x, points, labels: list):
        images = torch.tanh(self.image(x))
        outs = []
        for image, p, lab in zip(images, points, labels):  # (each image's record)
            c = self.coords(p[None])  # [1, N, 4], one image's points
            w = torch.cat([e.weight for e in self.point_embeddings])  # [2, 4]
            c = self.add(c, w, lab[None])
            outs.append(self.head(c.mean(1) + image[None]))
        return torch.cat(outs)


def _prompted(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(3, 3, generator=g, dtype=D)
    points = torch.randn(3, 2, 2, generator=g, dtype=D)
    labels = [torch.tensor(lab) for lab in ([0, 1], [1, 1], [0, 0])]
    return (x, points, labels), torch.randint(2, (3,), generator=g)


@pytest.mark.parametrize("labels_as", ["list", "tensor"])
@pytest.mark.parametrize("how", list(ADDED))
def test_a_parameter_added_into_one_examples_rows_trains_as_the_loop(how, labels_as):
    """Three SGD steps: ``grad1`` and the norms are the float64 loop's for every parameter,
    the embeddings added into one image's rows among them (once refused: no meeting of a
    parameter with rows picked from the batch ran in place). The labels are each image's
    record (a list), or rows of one tensor, each taken out alone by the loop over images
    (once taken for an index computed across the batch, and refused)."""
    model = Prompts(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(out, y):
        return F.cross_entropy(out, y, reduction="sum")

    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for step in range(3):
            inputs, y = _prompted(step)
            if labels_as == "tensor":
                inputs = (*inputs[:2], torch.stack(inputs[2]))
            ref = copy.deepcopy(model)
            want = {n: torch.zeros(3, *p.shape, dtype=D) for n, p in ref.named_parameters()}
            for i in range(3):  # (the loop: each image alone)
                one = (inputs[0][i : i + 1], inputs[1][i : i + 1], inputs[2][i : i + 1])
                got = torch.autograd.grad(loss(ref(*one), y[i : i + 1]), list(ref.parameters()))
                for (n, _), g in zip(ref.named_parameters(), got):
                    want[n][i] = g
            opt.zero_grad()
            h.clear()
            loss(model(*inputs), y).backward()
            assert_grad1(model, want, f"{how}, step {step}")
            torch.testing.assert_close(h.norms(), flat_norms(want))
            opt.step()


@pytest.mark.parametrize("how", ["in-place-slice", "by-label-mask"])
def test_a_parameter_added_into_one_examples_rows_under_bf16_autocast(how):
    """Under bfloat16 autocast the rows of ``grad1`` sum to autograd's ``.grad``, and are the
    float64 loop's to bfloat16's rounding."""
    model = Prompts(how)
    (x, points, labels), y = _prompted(0)
    x, points = x.float(), points.float()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, points, labels)
        F.cross_entropy(out.float(), y, reduction="sum").backward()
    ref = copy.deepcopy(model).double()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad1.sum(0), p.grad, rtol=2e-2, atol=2e-2, msg=n)
    for i in range(3):
        one = ref(x[i : i + 1].double(), points[i : i + 1].double(), labels[i : i + 1])
        got = torch.autograd.grad(F.cross_entropy(one, y[i : i + 1], reduction="sum"),
                                  list(ref.parameters()))  # fmt: skip
        for (n, p), g in zip(model.named_parameters(), got):
            assert (p.grad1[i].double() - g).abs().max() <= 5e-2 * g.abs().max() + 1e-3, n


# -- one example's indices and masks taken out alone ---------------------------------------------

TAKEN = {
    # wrong for every example but the first, before: taken for an index computed across the
    # batch, which only selects
    "mask-of-one-on-the-batch": lambda m, x, ids: m.lin(x) * (ids[0] > 1),
    "index-of-one-on-the-batch": lambda m, x, ids: m.lin(x)[:, ids[0] % 3],
}
OWN = {
    # each example's ids through a table, given back their batch dimension (refused before)
    "ids-regrown": lambda m, x, ids: torch.cat(
        [m.emb(ids[i][None]).sum(1) for i in range(len(ids))]
    ),
    "ids-iterated": lambda m, x, ids: torch.cat([m.emb(r[None]).sum(1) for r in ids]),
    # each example's own mask on its own rows (refused before)
    "own-mask-on-its-slice": lambda m, x, ids: torch.cat(
        [m.lin(x[i : i + 1]) * (ids[i] > 1) for i in range(len(ids))]
    ),
    "own-mask-regrown": lambda m, x, ids: torch.cat(
        [m.lin(x[i][None]) * (ids[i][None] > 1) for i in range(len(ids))]
    ),
}


class Taken(nn.Module):
    """A Linear on the examples and an embedding of each example's ids, combined by ``how``."""

    def __init__(self, how) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.emb, self.how = nn.Linear(3, 3), nn.Embedding(5, 3), how

    def forward(self, x, ids):
        return self.how(self, x, ids) + self.lin(x)


def _taken(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g, dtype=D), torch.randint(5, (4, 3), generator=g)


@pytest.mark.parametrize("how", list(TAKEN))
def test_one_examples_index_or_mask_applied_to_the_batch_is_refused(how):
    """``ids[0]`` (no gradient: an index or a mask) is the first example's alone; applied to
    every example's rows it mixes them (an example alone would apply its own): refused,
    naming what mixed, the model as it was. It was taken for an index computed across the
    batch, which only selects, and every example but the first had a wrong ``grad1``."""
    model = Taken(TAKEN[how]).to(D)
    x, ids = _taken(0)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        before = model_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["mixes the 4 examples", "__getitem__"],
            lambda: model(x, ids).pow(2).sum().backward(),
        )
        assert_untouched(model, before)


@pytest.mark.parametrize("how", list(OWN))
def test_one_examples_ids_or_mask_taken_out_alone_train_as_the_loop(how):
    """Two SGD steps: ``grad1`` and the norms are the float64 loop's, and the rows sum to
    ``.grad``."""
    model = Taken(OWN[how]).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for step in range(2):
            x, ids = _taken(step)
            ref = copy.deepcopy(model)
            want = {n: torch.zeros(4, *p.shape, dtype=D) for n, p in ref.named_parameters()}
            used = set()
            for i in range(4):
                got = torch.autograd.grad(
                    ref(x[i : i + 1], ids[i : i + 1]).pow(2).sum(), list(ref.parameters()),
                    allow_unused=True,
                )  # fmt: skip
                for (n, _), g in zip(ref.named_parameters(), got):
                    if g is not None:
                        want[n][i], _ = g, used.add(n)
            want = {n: g for n, g in want.items() if n in used}  # (the table: unused by some)
            opt.zero_grad()
            h.clear()
            model(x, ids).pow(2).sum().backward()
            for n, p in model.named_parameters():
                if n in want:
                    torch.testing.assert_close(p.grad1, want[n], msg=f"{how}, step {step}: {n}")
                    torch.testing.assert_close(p.grad1.sum(0), p.grad, msg=n)
                else:
                    assert not hasattr(p, "grad1") and p.grad is None, n
            torch.testing.assert_close(h.norms(), flat_norms(want))
            opt.step()

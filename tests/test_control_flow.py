"""A model whose control flow changes from one step to the next, under one set of hooks.

Each scenario is a short training loop as the docs write it (``add_hooks`` once, then per step:
``zero_grad``, forward, backward, read the per-example quantities, an optimizer step,
``hooks.clear()``), on a model that does something different at every step: a branch on the
batch's values that moves the examples to another dimension (with a sequence as long as the
batch, so that no shape tells), tokens permuted, folded or flipped along the batch or along the
sequence, another sequence length, another number of tokens per expert (an expert with none), a
layer skipped or called twice, dropout switched by ``train()``/``eval()``, a batch-free source
or a parameter used outside its module on some steps only, another batch size, and Hugging Face
GPT-2 and BERT with other lengths, other padding and other batch sizes.

At every step, every parameter's ``grad1``, its per-example norm and the whole-model norm, and a
``dp_sgd_step`` by book-keeping (norms only, no ``grad1``) are compared in float64 with the
per-example loop (:func:`gradhooks.oracle.loop_grad`) on an unhooked float64 twin holding the
same parameters, to ``1e-10`` of the parameter's largest entry (or of ``1e-6`` of the model's,
for a gradient that is zero but for rounding): the models are tiny, so only a wrong layout, a
stale capture or a lost term can differ by more than rounding. A parameter the step does not
reach has no ``grad1`` and no norm, as its ``.grad`` is ``None``.

Dropout in training mode draws its mask for the whole batch, which a loop over the examples
cannot draw again; there the reference is each example's own loss differentiated through the
twin's batched forward, run with the same seed (the same mask): example ``i``'s gradient, since
nothing else in that model couples the examples.

A cache that replays the previous step's layouts instead of following the new forward must fail
here: :func:`replayed_layouts` (the tracker's layout of each torch call, keyed on the calls'
positions or on the calls and their shapes) and :func:`replayed_calls` (the engine's layout of
each hooked call, keyed on the module and the shapes) simulate one, and the tests below require
the check to catch it, with ``verify=True`` too, at a step the run-time check does not redo.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.tracking.ops.common import tensor_args

D = torch.float64
RTOL = 1e-10  # of the largest entry of the reference, per parameter
BF16_TOL = 5e-2  # bfloat16: see test_bfloat16_autocast
LR = 0.05


# -- the scenarios -------------------------------------------------------------------------------


@dataclass
class Step:
    """One step's inputs (dimension 0: the examples), targets, and what changes in the model
    before it (a flag, ``train()``/``eval()``), applied to the hooked model and its twin."""

    inputs: tuple[Tensor, ...]
    target: Tensor | None = None
    setup: Callable[[nn.Module], None] | None = None
    seed: int = 0  # torch's seed for the forward (dropout)
    refused: bool = False  # the step must be refused (a typed error), the next ones right


@dataclass
class Scenario:
    id: str
    model: Callable[[], nn.Module]
    steps: Callable[[], list[Step]]
    losses: Callable[[Tensor, Tensor | None], Tensor]  # the per-example losses, [batch]
    oracle: str = "loop"  # "loop": loop_grad; "rows": each example's loss through the batch
    unreached: dict[int, set[str]] = field(default_factory=dict)  # step: names it must not reach

    def __repr__(self) -> str:
        return self.id


def squares(out: Tensor, target: Tensor | None = None) -> Tensor:
    """Half the sum of squares of each example's outputs, ``[batch]``."""
    return 0.5 * out.pow(2).flatten(1).sum(1)


def token_ce(out: Tensor, target: Tensor) -> Tensor:
    """Each example's cross-entropy summed over its tokens (``-100``: no loss), ``[batch]``."""
    return F.cross_entropy(out.transpose(1, 2), target, reduction="none").sum(1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(b: int, t: int, seed: int, first_positive: bool | None = None) -> Tensor:
    """``[b, t, 3]`` inputs; ``first_positive``: feature 0 positive everywhere (True) or
    negative at the first position of every example (False), so that a branch on
    ``(x[..., 0] > 0).all()`` goes the same way for the batch and for each example alone."""
    x = torch.randn(b, t, 3, generator=_gen(seed), dtype=D)
    if first_positive is True:
        x[..., 0] = x[..., 0].abs() + 0.1
    elif first_positive is False:
        x[:, 0, 0] = -1.0
    return x


def _positive(x: Tensor) -> bool:
    return bool((x[..., 0] > 0).all())


class Detour(nn.Module):
    """Tokens ``[B, T, 3]``; where feature 0 of every token is positive, a sequence-first detour
    (``transpose(0, 1)``, then seq-first attention and ``seq`` on ``[T, B, C]``); else ``seq``
    on the batch-first tensor. With ``T == B`` the shapes are the same either way."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.seq, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.attn = nn.MultiheadAttention(4, 2)  # sequence-first

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if _positive(x):
            s = h.transpose(0, 1)
            s = self.attn(s, s, s, need_weights=False)[0] + self.seq(s)
            h = h + torch.tanh(s).transpose(0, 1)
        else:
            h = h + torch.tanh(self.seq(h))
        return self.out(h)


class Reorder(nn.Module):
    """Where feature 0 of every token is positive, ``mid`` on the tokens with the batch moved,
    else with the sequence moved, then put back, by the same torch calls on the same shapes
    (``T == B``) either way:

    - ``"permute"``: sequence-first ``[T, B, C]``, or as it is;
    - ``"fold"``: the tokens folded into one dimension sequence-first (``[T * B, C]``, the
      examples inner) or batch-first (``[B * T, C]``, the examples outer);
    - ``"flip"``: the examples' order reversed, or the sequence's. A Linear whose rows are the
      examples in another order is refused (its rule would give example ``i`` another's
      gradient), so the flip along the batch is a step that must raise, and the steps after it
      be right."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.inp, self.mid, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.how == "flip":
            d = 0 if _positive(x) else 1
            h = self.mid(h.flip(d)).flip(d)
        elif self.how == "fold":
            d = 1 if _positive(x) else 0
            moved = h.transpose(0, d)
            h = self.mid(moved.reshape(-1, 4)).reshape(moved.shape).transpose(0, d)
        else:
            order = (1, 0, 2) if _positive(x) else (0, 1, 2)
            h = self.mid(h.permute(order)).permute(order)
        return self.out(torch.tanh(h))


# where the branch is taken, step by step: it changes first at the third backward (which the
# run-time check, on the 1st, 2nd, 4th, 8th... backward of the same calls, does not redo)
SIGNS = (False, False, True, True, False, True)
ATTENTION = {"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"}  # fmt: skip


def _branching(b: int = 4, refused: bool = False) -> list[Step]:
    """T == B; the branch taken as :data:`SIGNS` says (``refused``: where it is taken)."""
    return [Step((_tokens(b, b, k, s),), refused=refused and s) for k, s in enumerate(SIGNS)]


class Tokens(nn.Module):
    """Token ids ``[B, T]``: an embedding, a learned position embedding (``arange(T)``,
    broadcast into the batch), self-attention, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(11, 4), nn.Embedding(8, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 5)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.out(torch.tanh(h))


def _ids(shapes: list[tuple[int, int]]) -> list[Step]:
    steps = []
    for k, (b, t) in enumerate(shapes):
        g = _gen(k)
        steps.append(Step((torch.randint(11, (b, t), generator=g),), torch.randint(5, (b, t), generator=g)))  # fmt: skip
    return steps


class Experts(nn.Module):
    """Tokens ``[B, T, 3]``, each routed (top-1, gated) to one of three Linear experts, which
    see the tokens routed to them from every example; an expert with no token is not called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.router, self.out = nn.Linear(3, 4), nn.Linear(4, 3), nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        flat = h.reshape(-1, 4)
        gates = torch.softmax(self.router(flat), -1)
        choice = gates.argmax(-1)
        mixed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                y = expert(flat[rows]) * gates[rows, e : e + 1]
                mixed = mixed.index_add(0, rows, y)
        return self.out(h + mixed.reshape(h.shape))


def _routed(step: int) -> Callable[[nn.Module], None]:
    """The router's bias this step: expert 2 gets no token at step 1, expert 0 none at step 3,
    the others share the tokens as the inputs fall."""
    bias = {1: (0.0, 0.0, -100.0), 3: (-100.0, 0.0, 0.0)}.get(step, (0.0, 0.0, 0.0))

    def setup(m: nn.Module) -> None:
        with torch.no_grad():
            m.router.bias.copy_(torch.tensor(bias, dtype=m.router.bias.dtype))

    return setup


def _experts() -> list[Step]:
    return [Step((_tokens(4, 3 + k, 10 + k),), setup=_routed(k)) for k in range(5)]


class Switched(nn.Module):
    """Residual blocks run in the order ``self.plan`` gives (a block skipped, one run twice),
    dropout between them (``train()``/``eval()``)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.drop = nn.Dropout(p)
        self.plan: tuple[int, ...] = (0, 1, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for i in self.plan:
            h = h + self.drop(torch.tanh(self.blocks[i](h)))
        return self.out(h)


PLANS = [(0, 1, 2), (0, 2), (1, 1, 2), (2,), (), (0, 1, 2)]


def _planned(plan: tuple[int, ...]) -> Callable[[nn.Module], None]:
    def setup(m: nn.Module) -> None:
        m.plan = plan

    return setup


def _plans() -> list[Step]:
    return [Step((_tokens(4, 2, k),), setup=_planned(p)) for k, p in enumerate(PLANS)]


def _modes() -> list[Step]:
    modes = ["train", "eval", "train", "train", "eval"]
    return [Step((_tokens(4, 3, k),), setup=lambda m, mode=mode: getattr(m, mode)(), seed=k)
            for k, mode in enumerate(modes)]  # fmt: skip


class Sources(nn.Module):
    """Tokens ``[B, T, 3]``. ``positions``: a learned position embedding added (a hooked call on
    ``arange(T)``: batch-free, broadcast into the batch);
    ``tied``: ``mid``'s weight used outside ``mid`` (``F.linear``) instead of calling it;
    ``scaled``: the model's own ``scale`` used in its forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.pos = nn.Embedding(6, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.positions = self.tied = self.scaled = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.positions:
            h = h + torch.tanh(self.pos(torch.arange(x.shape[1])))
        h = torch.tanh(h)
        h = F.linear(h, self.mid.weight) if self.tied else self.mid(h)
        if self.scaled:
            h = h * self.scale
        return self.out(torch.tanh(h))


def _flags(**flags: bool) -> Callable[[nn.Module], None]:
    def setup(m: nn.Module) -> None:
        m.positions, m.tied, m.scaled = (flags.get(k, False) for k in ("positions", "tied", "scaled"))  # fmt: skip

    return setup


def _sources() -> list[Step]:
    flags = [{}, {"positions": True}, {"tied": True, "scaled": True}, {"positions": True,
             "tied": True}, {"scaled": True}, {}]  # fmt: skip
    return [Step((_tokens(4, 4 if k % 2 else 5, k),), setup=_flags(**f)) for k, f in enumerate(flags)]  # fmt: skip


class GPT2(nn.Module):
    """A tiny Hugging Face GPT-2 (2 layers of width 16) called with an attention mask."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_embd=16, n_layer=2, n_head=2, n_positions=16, vocab_size=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


class Bert(nn.Module):
    """A tiny Hugging Face BERT classifier (2 layers of width 16), with an attention mask."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3,
        )  # fmt: skip
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


def _classified(lengths: list[int], t: int, seed: int) -> Step:
    """Right-padded token ids, their mask and a class per sequence."""
    step = _padded(lengths, t, seed)
    label = torch.randint(3, (len(lengths),), generator=_gen(100 + seed))
    return Step(step.inputs, label)


def _bert_steps() -> list[Step]:
    return [
        _classified([5, 3, 5], 5, 0),
        _classified([7, 7, 2, 6], 7, 1),
        _classified([4, 1, 3, 4], 4, 2),  # T == B
        _classified([6, 6, 6, 6], 6, 3),  # no padding
        _classified([3], 3, 4),  # one example
    ]


def sequence_ce(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="none")


def _padded(lengths: list[int], t: int, seed: int) -> Step:
    """Right-padded token ids ``[len(lengths), t]``, their mask, and next-token targets
    (``-100`` on padding and on the last token)."""
    g = _gen(seed)
    ids = torch.randint(32, (len(lengths), t), generator=g)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()
    target = torch.full_like(ids, -100)
    target[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
    return Step((ids, mask), target)


def _gpt2_steps() -> list[Step]:
    return [
        _padded([6, 6, 6], 6, 0),  # no padding
        _padded([6, 3, 5], 6, 1),  # padding
        _padded([3, 2, 3], 3, 2),  # shorter, T == B
        _padded([8, 8, 1, 4], 8, 3),  # longer, another batch
        _padded([5, 5], 5, 4),  # last batch smaller
    ]


def gpt2_losses(out: Tensor, target: Tensor) -> Tensor:
    return token_ce(out, target)


SCENARIOS = [
    Scenario("seq-first-detour", Detour, _branching, squares,
             unreached={k: ATTENTION for k, s in enumerate(SIGNS) if not s}),
    Scenario("flip-batch-or-sequence", lambda: Reorder("flip"), lambda: _branching(refused=True),
             squares),
    Scenario("permute-batch-or-sequence", lambda: Reorder("permute"), _branching, squares),
    Scenario("fold-batch-or-sequence", lambda: Reorder("fold"), _branching, squares),
    Scenario("sequence-length", Tokens, lambda: _ids([(4, 5), (4, 4), (4, 7), (4, 1), (4, 4)]),
             token_ce),
    Scenario("batch-size", Tokens, lambda: _ids([(4, 3), (4, 3), (3, 3), (2, 3), (1, 3)]),
             token_ce),
    Scenario("tokens-per-expert", Experts, _experts, squares,
             unreached={1: {"experts.2.weight", "experts.2.bias"},
                        3: {"experts.0.weight", "experts.0.bias"}}),
    Scenario("layers-skipped-or-twice", Switched, _plans, squares,
             unreached={1: {"blocks.1.weight", "blocks.1.bias"},
                        2: {"blocks.0.weight", "blocks.0.bias"},
                        3: {f"blocks.{i}.{w}" for i in (0, 1) for w in ("weight", "bias")},
                        4: {f"blocks.{i}.{w}" for i in (0, 1, 2) for w in ("weight", "bias")}}),
    Scenario("dropout-train-eval", lambda: Switched(p=0.5), _modes, squares, oracle="rows"),
    Scenario("sources-some-steps", Sources, _sources, squares,
             unreached={0: {"pos.weight", "scale"}, 1: {"scale"}, 3: {"scale"}, 4: {"pos.weight"},
                        5: {"pos.weight", "scale"}}),
    Scenario("hf-gpt2-padding-lengths", GPT2, _gpt2_steps, gpt2_losses),
    Scenario("hf-bert-padding-lengths", Bert, _bert_steps, sequence_ce),
]  # fmt: skip
BY_ID = {s.id: s for s in SCENARIOS}


# -- the reference and the loop ------------------------------------------------------------------


def reference(twin: nn.Module, s: Scenario, step: Step) -> dict[str, Tensor]:
    """Each example's own gradient, ``{name: [batch, *shape]}``, in float64 on the twin."""
    inputs = tuple(x.double() if x.is_floating_point() else x for x in step.inputs)
    if s.oracle == "loop":
        return loop_grad(twin, lambda out, y=None: s.losses(out, y).sum(), inputs, step.target)
    named = [(n, p) for n, p in twin.named_parameters() if p.requires_grad]
    torch.manual_seed(step.seed)
    losses = s.losses(twin(*inputs), step.target)
    rows = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], [p for _, p in named], retain_graph=True,
                                    allow_unused=True)  # fmt: skip
        rows.append([torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)])
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


def _close(got: Tensor, want: Tensor, tol: float, what: str, floor: float = 0.0) -> None:
    """``got`` within ``tol`` of the largest entry of ``want``, or of ``floor`` where that is
    larger (a gradient that is zero but for rounding: the bias of an attention's keys)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    bound = tol * max(scale, floor, 1e-30)
    assert err <= bound, f"{what}: max abs diff {err:.3e}, largest {scale:.3e}"


def _floor(want: dict[str, Tensor]) -> float:
    """``1e-6`` of the largest entry of any parameter's reference: the scale below which a
    parameter's gradient is taken as zero but for rounding."""
    return 1e-6 * max((g.abs().max().item() for g in want.values() if g.numel()), default=0.0)


def _twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).double()


def _sync(twin: nn.Module, model: nn.Module) -> None:
    with torch.no_grad():
        for p, q in zip(twin.parameters(), model.parameters()):
            p.copy_(q)


def _clip_norm(want: dict[str, Tensor]) -> float:
    """A clipping norm that clips about half of the examples."""
    total = _total(want)
    return float(total.median()) if total.numel() > 1 else float(total.max()) / 2


def _total(want: dict[str, Tensor]) -> Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()


def train(
    s: Scenario,
    how: str = "grad1",
    *,
    dtype: torch.dtype = D,
    autocast: torch.dtype | None = None,
    tol: float = RTOL,
    verify: bool = False,
) -> int:
    """Run scenario ``s``'s steps with one set of hooks and check every step (``how``:
    ``"grad1"``: grad1, per-parameter and whole-model norms; ``"dp"``: ``dp_sgd_step`` by
    book-keeping, clipping without noise). Returns the number of steps checked."""
    model = s.model().to(dtype)
    twin = _twin(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    quantities = ("grad1", "norms") if how == "grad1" else ("norms",)
    hooks = gradhooks.add_hooks(model, loss_reduction="sum", quantities=quantities, verify=verify)
    steps = s.steps()
    with hooks:
        for k, step in enumerate(steps):
            what = f"{s.id}, step {k}"
            if step.setup is not None:
                step.setup(model)
                step.setup(twin)
            _sync(twin, model)
            want = reference(twin, s, step)
            for name in s.unreached.get(k, ()):
                assert not want[name].any(), f"{what}: the reference reaches {name}"
            inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in step.inputs)
            optimizer.zero_grad()
            if step.refused:
                try:
                    s.losses(model(*inputs), step.target).sum().backward()
                except gradhooks.GradhooksError:
                    hooks.clear()
                    continue
                raise AssertionError(f"{what}: not refused (its rule reads reordered examples)")
            torch.manual_seed(step.seed)
            ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
            with ctx:
                out = model(*inputs)
            losses = s.losses(out.float() if autocast else out, step.target)
            if how == "grad1":
                losses.sum().backward()
                _check_grad1(model, hooks, want, tol, what)
            else:
                _check_dp(model, hooks, losses, want, tol, what)
            optimizer.step()
            hooks.clear()
    return len(steps)


def _check_grad1(model, hooks, want, tol, what) -> None:
    floor = _floor(want)
    norms = hooks.param_norms()
    for name, p in model.named_parameters():
        if p.grad is None:
            assert not want[name].any(), f"{what}: {name} has no .grad, the reference has one"
            assert not hasattr(p, "grad1"), f"{what}: {name} keeps a grad1 the step did not reach"
            assert name not in norms or not norms[name].any(), f"{what}: {name} keeps a norm"
            continue
        _close(p.grad1, want[name], tol, f"{what}: {name} grad1", floor)
        _close(norms[name], want[name].flatten(1).norm(dim=1), tol, f"{what}: {name} norm", floor)
    _close(hooks.norms(), _total(want), tol, f"{what}: whole-model norms")


def _check_dp(model, hooks, losses, want, tol, what) -> None:
    floor = _floor(want)
    max_norm = _clip_norm(want)
    got = gradhooks.dp_sgd_step(hooks, losses, max_norm=max_norm, noise_multiplier=0.0,
                                reduction="sum")  # fmt: skip
    total = _total(want)
    _close(got, total, tol, f"{what}: norms before clipping")
    factors = gradhooks.clip_factors(total, max_norm)
    for name, p in model.named_parameters():
        expected = torch.einsum("b,b...->...", factors, want[name])
        if p.grad is None:
            assert not expected.any(), f"{what}: {name} has no .grad, the reference has one"
            continue
        _close(p.grad, expected, tol, f"{what}: {name} clipped sum", floor)


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["grad1", "dp"])
@pytest.mark.parametrize("s", SCENARIOS, ids=repr)
def test_every_step_against_the_loop(s, how):
    """Every step's grad1 and norms (or book-keeping DP step) in float64, to 1e-10."""
    assert train(s, how) == len(s.steps())


VERIFIED = ["seq-first-detour", "fold-batch-or-sequence", "tokens-per-expert",
            "layers-skipped-or-twice", "sources-some-steps"]  # fmt: skip


@pytest.mark.parametrize("s", [BY_ID[n] for n in VERIFIED], ids=repr)
def test_with_the_run_time_check(s):
    """As users run it (``verify=True``): the check of each new set of calls passes and the
    numbers are the same."""
    train(s, verify=True)


@pytest.mark.parametrize("s", [BY_ID["seq-first-detour"], BY_ID["sequence-length"]], ids=repr)
def test_bfloat16_autocast(s):
    """A float32 model under bfloat16 autocast against the float64 loop. bfloat16 keeps 8
    significant bits (unit roundoff ``2⁻⁹ ≈ 2e-3``); each factor of a per-example gradient
    carries a few roundings through the 3-4 layers here, summed over positions whose errors
    do not cancel: ``5e-2`` of the largest entry allows ~25 units (the bound of
    ``tests/test_autocast.py``; seen: ``6e-3``), while a layout from another step is wrong by
    the order of the gradient itself (relative error ~1)."""
    train(s, dtype=torch.float32, autocast=torch.bfloat16, tol=BF16_TOL)


def test_make_private_with_changing_layers():
    """``make_private``: Poisson batches (a new size each step) through a model that skips or
    repeats a block each step. Without noise, each step's ``p.grad`` is the clipped sum of the
    loop's per-example gradients over the expected batch size."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 2, 3, dtype=D))
    model = Switched().double()
    twin = _twin(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    private = gradhooks.make_private(
        model, optimizer, data, noise_multiplier=0.0, delta=1e-5, epochs=1,
        expected_batch_size=6, max_grad_norm=0.5, generator=_gen(3),
    )  # fmt: skip
    seen: dict[str, Tensor] = {}  # p.grad as the wrapped optimizer steps on it
    names = {id(p): n for n, p in model.named_parameters()}

    def record(opt, args, kwargs) -> None:
        seen.clear()
        for group in opt.param_groups:
            for p in group["params"]:
                seen[names[id(p)]] = torch.zeros_like(p) if p.grad is None else p.grad.clone()

    optimizer.register_step_pre_hook(record)
    sizes = []
    try:
        for k, (xb,) in enumerate(private.batches()):
            plan = PLANS[k % len(PLANS)]
            model.plan = twin.plan = plan
            _sync(twin, model)
            want = loop_grad(twin, lambda out: squares(out).sum(), xb)
            private.backward(squares(model(xb)))
            private.step()
            sizes.append(xb.shape[0])
            total = _total(want) if xb.shape[0] else torch.zeros(0, dtype=D)
            factors = gradhooks.clip_factors(total, 0.5)
            assert set(seen) == set(names.values()), f"step {k}: the optimizer did not step"
            for name, got in seen.items():
                expected = torch.einsum("b,b...->...", factors, want[name]) / 6
                _close(got, expected, RTOL, f"make_private step {k} (plan {plan}): {name}")
    finally:
        private.close()
    assert len(set(sizes)) > 1, f"the Poisson batches all had the same size: {sizes}"


# -- the check can fail --------------------------------------------------------------------------


@contextlib.contextmanager
def replayed_layouts(monkeypatch, key: str):
    """The tracker, but with a cache of layouts from the previous forward, blind to where the
    examples are: ``key="position"``: the i-th torch call gets the layout the previous
    forward's i-th call got wherever the two have the same name (a cache keyed on the code
    path); ``key="shapes"``: the j-th call of a name on arguments of given shapes gets the
    layout of the previous forward's j-th such call (a cache keyed on the calls and shapes).
    Yields the number of layouts replayed so far (``memory["replayed"]``)."""
    from gradhooks.tracking import propagate
    from gradhooks.tracking import tracker as tracking

    real_layout, real_enter = propagate.output_layout, tracking.Tracker.__enter__
    memory: dict = {"last": [], "now": [], "replayed": 0}

    def enter(self):
        if memory["now"]:
            memory["last"], memory["now"] = memory["now"], []
        return real_enter(self)

    def output_layout(name, args, kwargs, out, layout_of, batch, *rest):
        shapes = tuple(tuple(t.shape) for t in tensor_args(args, kwargs))
        this = name if key == "position" else (name, shapes)
        if key == "position":
            i = len(memory["now"])
        else:  # the index of the same occurrence in the previous forward
            j = sum(1 for k, _ in memory["now"] if k == this)
            found = [i for i, (k, _) in enumerate(memory["last"]) if k == this]
            i = found[j] if j < len(found) else len(memory["last"])
        last = memory["last"]
        if i < len(last) and last[i][0] == this:
            result = last[i][1]
            memory["replayed"] += 1
        else:
            result = real_layout(name, args, kwargs, out, layout_of, batch, *rest)
        memory["now"].append((this, result))
        return result

    monkeypatch.setattr(propagate, "output_layout", output_layout)
    monkeypatch.setattr(tracking.Tracker, "__enter__", enter)
    yield memory


@contextlib.contextmanager
def replayed_calls(monkeypatch):
    """The engine, but with a cache of where the examples are in each hooked call, kept from
    the previous forward: the j-th call of a module on arguments of given shapes gets the
    layout of the previous forward's j-th such call (a cache keyed on the module and the
    shapes). Yields the number of call layouts replayed so far (``memory["replayed"]``). The
    engine's own replay of the usual call (:meth:`ForwardCapture.replay_usual`, which asks
    again what a call's layout is made of) is off: every call's layout is this cache's."""
    from gradhooks.engine import calls, forward
    from gradhooks.tracking import tracker as tracking

    monkeypatch.setattr(forward.ForwardCapture, "replay_usual", lambda *a: forward.FULL)

    real_layout, real_enter = calls.CallLayouts.call_layout, tracking.Tracker.__enter__
    memory: dict = {"last": {}, "now": {}, "replayed": 0}

    def enter(self):
        if memory["now"]:
            memory["last"], memory["now"] = memory["now"], {}
        return real_enter(self)

    def call_layout(self, target, args, kwargs, output, tracker, *leaves):
        shapes = tuple(tuple(t.shape) for t in tensor_args(args, kwargs))
        seen = memory["now"].setdefault((target.name, shapes), [])
        before = memory["last"].get((target.name, shapes), [])
        if tracker is not None and len(seen) < len(before):
            found = before[len(seen)]
            memory["replayed"] += 1
        else:
            found = real_layout(self, target, args, kwargs, output, tracker, *leaves)
        seen.append(found)
        return found

    monkeypatch.setattr(calls.CallLayouts, "call_layout", call_layout)
    monkeypatch.setattr(tracking.Tracker, "__enter__", enter)
    yield memory


# (scenario, cache key, what catches it): AssertionError, the comparison with the loop (the
# replay gave a silently wrong grad1, or let through a step that must be refused);
# GradhooksError, the engine (it refused a step that is right)
REPLAYS = [
    ("seq-first-detour", "shapes", gradhooks.GradhooksError),
    ("permute-batch-or-sequence", "position", AssertionError),
    ("permute-batch-or-sequence", "shapes", AssertionError),
    ("fold-batch-or-sequence", "position", AssertionError),
    ("fold-batch-or-sequence", "shapes", AssertionError),
    ("flip-batch-or-sequence", "position", AssertionError),
    ("tokens-per-expert", "shapes", gradhooks.GradhooksError),
]


@pytest.mark.parametrize(
    ("name", "key", "caught"), REPLAYS, ids=[f"{n}-{k}" for n, k, _ in REPLAYS]
)
def test_a_replayed_layout_fails_the_check(monkeypatch, name, key, caught):
    """The check is not blind: with layouts replayed from the step before, the step after a
    change of control flow fails the comparison with the loop (a wrong grad1, which nothing
    else would have caught), or is refused."""
    with replayed_layouts(monkeypatch, key) as memory:
        with pytest.raises(caught, match="step 2|'mid'|'out'"):
            train(BY_ID[name])
    assert memory["replayed"], "the replay never ran"


CALL_REPLAYS = [
    "seq-first-detour",
    "permute-batch-or-sequence",
    "fold-batch-or-sequence",
]


@pytest.mark.parametrize("name", CALL_REPLAYS)
def test_a_replayed_call_layout_fails_the_check(monkeypatch, name):
    """Likewise with the engine's layout of each hooked call replayed from the step before
    wherever the module and the shapes are the same: step 2 gives a wrong grad1, and the
    comparison with the loop says so."""
    with replayed_calls(monkeypatch) as memory:
        with pytest.raises(AssertionError, match="step 2"):
            train(BY_ID[name])
    assert memory["replayed"], "the replay never ran"


@pytest.mark.parametrize("name", ["permute-batch-or-sequence", "fold-batch-or-sequence"])
def test_a_replay_the_run_time_check_skips_is_caught_here(monkeypatch, name):
    """With ``verify=True``, as users run it: the run-time check redoes the 1st, 2nd, 4th,
    8th... backward of the same calls, and the branch first changes at the 3rd, where a
    replayed call layout gives a wrong grad1 that it does not see (seen: 0.15 off of 0.19);
    the comparison with the loop does (or, should the run-time check learn to, the engine)."""
    with replayed_calls(monkeypatch) as memory:
        with pytest.raises((AssertionError, gradhooks.GradhooksError), match="step 2|gradhooks"):
            train(BY_ID[name], verify=True)
    assert memory["replayed"], "the replay never ran"


@pytest.mark.parametrize("key", ["position", "shapes", "calls"])
def test_the_replay_alone_is_harmless(monkeypatch, key):
    """The simulated cache is only wrong where the control flow changes: on steps that all take
    the same path (the same torch calls, the batch where it was) it passes, so the failures
    above are the check catching the change, not the simulation breaking everything."""
    same = Scenario("same-path", lambda: Reorder("permute"),
                    lambda: [Step((_tokens(4, 4, k, True),)) for k in range(3)], squares)  # fmt: skip
    replay = replayed_calls(monkeypatch) if key == "calls" else replayed_layouts(monkeypatch, key)
    with replay as memory:
        assert train(same) == 3
    assert memory["replayed"], "the replay never ran"

"""Sizes never decide: a batch as long as a shared input, batch sizes that change from step to
step, and batches without examples, on dimension 0 or another. Each is checked against the
float64 per-example loop (example ``i`` being ``x.narrow(batch_dim, i, 1)``, every shared input
as it is), or refused with an error naming the module, the parameter and the shapes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gradhooks
from harness import assert_close

D = torch.float64


def sq(out) -> Tensor:
    return 0.5 * out.pow(2).sum()


def loop_rows(model: nn.Module, x: Tensor, *shared, dim: int = 0) -> dict[str, Tensor]:
    """The float64 per-example loop: example ``i`` is ``x.narrow(dim, i, 1)``, with every
    ``shared`` input as it is."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[dim]):
        out = model(x.narrow(dim, i, 1), *shared)
        rows.append(torch.autograd.grad(sq(out), list(named.values()), allow_unused=True))
    return {
        n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        if rows else p.new_zeros((0, *p.shape))
        for k, (n, p) in enumerate(named.items())
    }  # fmt: skip


# -- batches without examples -----------------------------------------------------------------


def _emb() -> nn.Module:
    return nn.Embedding(5, 3)


class _EmbLSTM(nn.Module):
    """Opacus' embedding test, sequence-first: tokens ``[time, batch]``, then an LSTM."""

    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.out = nn.Embedding(5, 3), nn.LSTM(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


EMPTY = {
    "embedding [T, 0]": (_emb, lambda t: torch.zeros(t, 0, dtype=torch.long)),
    "embedding [T, 0, Q]": (_emb, lambda t: torch.zeros(t, 0, 2, dtype=torch.long)),
    "linear [T, 0, F]": (lambda: nn.Linear(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "lstm [T, 0, F]": (lambda: nn.LSTM(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "rnn [T, 0, F]": (lambda: nn.RNN(3, 2), lambda t: torch.zeros(t, 0, 3, dtype=D)),
    "embedding-lstm [T, 0]": (_EmbLSTM, lambda t: torch.zeros(t, 0, dtype=torch.long)),
}


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("time", [1, 3], ids=["T=1", "T=3"])
@pytest.mark.parametrize("case", list(EMPTY))
def test_no_example_on_dimension_1(case, time, quantity):
    """``batch_dim=1`` and a batch of 0 (``[T, 0, ...]``): grad1 ``[0, *p.shape]`` (norms
    ``[0]``), as for an empty batch on dimension 0, whatever dimension the layers read."""
    make, inputs = EMPTY[case]
    torch.manual_seed(0)
    m = make().double()
    x = inputs(time)
    with gradhooks.add_hooks(m, batch_dim=1, quantities=(quantity,)) as h:
        out = m(x)
        sq(out[0] if isinstance(out, tuple) else out).backward()
        for n, p in m.named_parameters():
            if quantity == "grad1":
                assert_close(p.grad1, p.new_zeros((0, *p.shape)), f"{case} {n}")
            else:
                assert h.param_norms()[n].shape == (0,), f"{case} {n}"


@pytest.mark.parametrize("time", [1, 3], ids=["T=1", "T=3"])
@pytest.mark.parametrize("case", ["embedding [T, 0]", "linear [T, 0, F]", "embedding-lstm [T, 0]"])
def test_an_empty_first_input_is_not_taken_for_examples(case, time):
    """``batch_dim="auto"`` on ``[T, 0, ...]`` (dimension 0 as the batch, the layers' rows
    counting ``T`` examples without entries): refused, saying to name the batch dimension;
    never ``T`` rows of zeros taken for examples."""
    make, inputs = EMPTY[case]
    m = make().double()
    with gradhooks.add_hooks(m), pytest.raises(ValueError, match=r"no entries.*batch_dim=k"):
        out = m(inputs(time))
        sq(out[0] if isinstance(out, tuple) else out).backward()
    assert all(not hasattr(p, "grad1") for p in m.parameters())


@pytest.mark.parametrize("case", ["embedding [T, 0]", "linear [T, 0, F]"])
def test_examples_without_entries_on_dimension_0(case):
    """``batch_dim=0`` on ``[B, 0, ...]``: ``B`` examples without entries, each with a zero
    gradient, as the per-example loop gives (was: a reshape error in the Linear's piece)."""
    make, inputs = EMPTY[case]
    m = make().double()
    x = inputs(3)
    want = loop_rows(m, x)
    with gradhooks.add_hooks(m, batch_dim=0, loss_reduction="sum"):
        sq(m(x)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], f"{case} {n}")

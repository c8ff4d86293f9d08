"""Sequences packed along one dimension without padding: flash-attention's varlen inputs (``x
[total_tokens, F]`` with ``cu_seqlens``) and Hugging Face's padding-free batches
(``DataCollatorWithFlattening``: ``input_ids [1, total_tokens]``, ``position_ids`` starting again
at each sequence). Each sequence is an example, but the batch would be read from a dimension whose
entries are tokens, or one whole pack: refused where the model is entered, naming the input,
before anything runs; the model is then as it was, and a padded batch of the same sequences is
checked against the float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from harness import assert_close, hf

D = torch.float64


class Varlen(nn.Module):
    """Attention within each sequence: packed (``x [total, F]`` with ``cu_seqlens``, as
    flash-attention's varlen API takes them) or padded (``x [B, T, F]``, equal lengths)."""

    def __init__(self, f: int = 6):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(f, f, dtype=D) for _ in range(4))

    def attend(self, x: Tensor) -> Tensor:  # one sequence [T, F] or a batch [B, T, F]
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.o(scores.softmax(-1) @ self.v(x))

    def forward(self, x: Tensor, cu_seqlens: Tensor | None = None, **kwargs) -> Tensor:
        if cu_seqlens is None:
            return self.attend(x)
        bounds = cu_seqlens.tolist()
        return torch.cat([self.attend(x[s:e]) for s, e in zip(bounds, bounds[1:])])


def _sq(out: Tensor) -> Tensor:
    return 0.5 * out.pow(2).sum()


def _loop(model: nn.Module, loss, size: int) -> dict[str, Tensor]:
    """The float64 per-example loop: ``loss(slice(b, b + 1))`` for each example ``b``."""
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss(slice(b, b + 1)), list(params.values()), allow_unused=True)
            for b in range(size)]  # fmt: skip
    return {n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(params.items())}  # fmt: skip


def _padded_check(model: Varlen, x: Tensor) -> None:
    """grad1 of a padded batch equals the float64 per-example loop."""
    want = gradhooks.oracle.loop_grad(model, _sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _sq(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)
        del p.grad1
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["positional", "cu_seqlens", "cu_seq_lens_q", "seq_idx"])
def test_varlen_input_is_refused_naming_it(how):
    torch.manual_seed(0)
    model = Varlen()
    x = torch.randn(3, 4, 6, dtype=D)  # 3 sequences of 4 tokens
    packed, cu = x.reshape(12, 6), torch.tensor([0, 4, 8, 12])
    # (the packed forward computes what the padded one does: each sequence is an example)
    torch.testing.assert_close(model(packed, cu).view(3, 4, 6), model(x))
    name = {"positional": "cu_seqlens"}.get(how, how)
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.UnsupportedInputError, match=rf"'Varlen' \(the model\) got {name} \(shape "
        ):
            if how == "positional":
                model(packed, cu)
            elif how == "seq_idx":
                model(packed, seq_idx=torch.arange(3).repeat_interleave(4))
            else:
                model(packed, **{how: cu})
    assert not any(hasattr(p, "grad1") or p.grad is not None for p in model.parameters())
    _padded_check(model, x)  # the model as it was


def test_varlen_error_says_what_to_do():
    model = Varlen()
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.UnsupportedInputError) as e:
        model(torch.randn(5, 6, dtype=D), torch.tensor([0, 2, 5]))
    msg = str(e.value)
    assert "x (5, 6), cu_seqlens (3,)" in msg and "padded batch" in msg and "attention_mask" in msg


def test_position_ids_counting_on_are_accepted():
    """``position_ids`` that run on by one in each row (a shared ``[1, T]`` row, or an offset)
    are no packing: the batch is read as usual."""

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.out = nn.Embedding(7, 4), nn.Embedding(16, 4), nn.Linear(4, 2)
            self.double()

        def forward(self, input_ids, position_ids=None):
            return self.out(self.emb(input_ids) + self.pos(position_ids))

    model = Positions()
    ids = torch.randint(7, (3, 5))
    for pos in (torch.arange(5)[None], torch.arange(2, 7).expand(3, 5)):
        rows = pos if pos.shape[0] == 3 else pos.expand(3, 5)
        want = _loop(model, lambda b, rows=rows: _sq(model(ids[b], rows[b])), 3)
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            _sq(model(ids, position_ids=pos)).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
            del p.grad1
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("passed", ["positional", "keyword"])
def test_packed_position_ids_are_refused_however_passed(passed):
    """``position_ids`` that start again within a row, without an attention mask, are refused
    whether they come by keyword or by position (the signature read once per forward
    function: a call passing none of the inputs looked at skips the binding)."""

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.out = nn.Embedding(7, 4), nn.Embedding(16, 4), nn.Linear(4, 2)

        def forward(self, input_ids, position_ids=None):
            pos = torch.zeros_like(input_ids) if position_ids is None else position_ids
            return self.out(self.emb(input_ids) + self.pos(pos))

    model = Positions()
    ids = torch.randint(7, (1, 7))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with gradhooks.add_hooks(model):
        model(ids).sum().backward()  # (no position_ids: the batch read as usual)
        assert model.out.weight.grad1.shape == (1, 2, 4)
        with pytest.raises(gradhooks.UnsupportedInputError, match="position_ids"):
            if passed == "positional":
                model(ids, packed)
            else:
                model(ids, position_ids=packed)


# -- Hugging Face's padding-free batches --------------------------------------------------------

SEQS = [[1, 5, 7, 9], [3, 4, 2], [8, 6, 5, 4, 3]]


def _llama():
    cfg = hf("LlamaConfig")(vocab_size=16, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                            attn_implementation="eager", pad_token_id=0)  # fmt: skip
    return hf("LlamaForCausalLM")(cfg).double()


def _gpt2():
    cfg = hf("GPT2Config")(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                           resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                           attn_implementation="eager")  # fmt: skip
    return hf("GPT2LMHeadModel")(cfg).double()


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_flattened_batch_is_refused(make, use_cache):
    """``DataCollatorWithFlattening`` packs the sequences into one row. Llama without a cache
    keeps them apart (its mask is built from ``position_ids``); with a cache, and GPT-2, attend
    across them. Either way the row is not an example: refused, naming ``position_ids``."""
    torch.manual_seed(0)
    model = make()
    batch = hf("DataCollatorWithFlattening")(return_tensors="pt")([{"input_ids": s} for s in SEQS])
    assert batch["input_ids"].shape == (1, 12)
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.UnsupportedInputError,
            match=r"got position_ids \(shape \(1, 12\)\) that start",
        ):
            model(**batch, use_cache=use_cache)
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_padded_batch_with_its_mask_is_accepted():
    """A padded batch, one sequence per row, with its ``attention_mask`` and ``position_ids``
    that do not count on by one over the padding (filled with 1 there, as ``generate`` does):
    each row an example, checked against the float64 per-example loop."""
    torch.manual_seed(0)
    model = _llama().eval()
    longest = max(map(len, SEQS))
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in SEQS])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, -100)
    assert bool((pos.diff(dim=-1) != 1).any())

    def loss(i: int | slice) -> Tensor:
        logits = model(input_ids=ids[i], attention_mask=mask[i], position_ids=pos[i],
                       use_cache=False).logits  # fmt: skip
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[i][:, 1:], reduction="sum")

    want = _loop(model, loss, len(SEQS))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(slice(None)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)

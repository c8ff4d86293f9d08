"""grad1's memory is written over in place only when nothing else refers to it: a grad1 the
caller kept (reference, view, numpy array, container) is never changed by a later backward."""

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.models import LeNet
from gradhooks.oracle import vmap_grad


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = LeNet().double()
    batches = [(torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(10, (4,)))
               for _ in range(3)]  # fmt: skip
    return model, batches


def _step(model, hooks, x, y):
    hooks.clear()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize(
    "keep",
    [lambda t: t, lambda t: t[1:], lambda t: t.view(-1), lambda t: t.numpy(), lambda t: [t],
     lambda t: t.detach()],
    ids=["reference", "slice", "view", "numpy", "container", "detach"],
)  # fmt: skip
def test_kept_grad1_is_never_changed(keep):
    model, batches = _setup()
    p = model.fc1.weight
    with gradhooks.add_hooks(model) as hooks:
        _step(model, hooks, *batches[0])
        kept = keep(p.grad1)
        snapshot = p.grad1.clone()
        _step(model, hooks, *batches[1])
        if isinstance(kept, list):
            assert torch.equal(kept[0], snapshot)
        else:
            assert torch.equal(torch.as_tensor(kept), torch.as_tensor(keep(snapshot)))
        want = vmap_grad(model, F.cross_entropy, *batches[1])
        torch.testing.assert_close(p.grad1, want["fc1.weight"])


def test_unreferenced_grad1_memory_is_reused_and_correct():
    model, batches = _setup()
    with gradhooks.add_hooks(model) as hooks:
        _step(model, hooks, *batches[0])
        before = {n: p.grad1.data_ptr() for n, p in model.named_parameters()}
        for x, y in batches[1:]:
            _step(model, hooks, x, y)
            want = vmap_grad(model, F.cross_entropy, x, y)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, want[n])
                if n.startswith("fc"):  # Linear pieces write in place (a rule may not)
                    assert p.grad1.data_ptr() == before[n], n


def test_accumulation_in_place_and_kept_reference():
    """Two backwards without clear() add up, in place or not; a kept grad1 stays."""
    model, batches = _setup()
    (x, y), _, _ = batches
    want = vmap_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model) as hooks:
        _step(model, hooks, x, y)
        F.cross_entropy(model(x), y).backward()  # unreferenced: accumulated in place
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, 2 * want[n])
        kept = model.fc2.weight.grad1
        F.cross_entropy(model(x), y).backward()  # referenced: a new tensor
        torch.testing.assert_close(kept, 2 * want["fc2.weight"])
        torch.testing.assert_close(model.fc2.weight.grad1, 3 * want["fc2.weight"])


def test_batch_size_change_within_accumulation_still_raises():
    model, batches = _setup()
    x, y = batches[0]
    with gradhooks.add_hooks(model) as hooks:
        _step(model, hooks, x, y)
        with pytest.raises(gradhooks.StateError, match="batch size changed"):
            F.cross_entropy(model(x[:2]), y[:2]).backward()

"""The same checks on a CUDA device (skipped where there is none)."""

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.models import SimpleCNN
from gradhooks.oracle import vmap_grad

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_simple_cnn_on_cuda_matches_vmap(reduction):
    torch.manual_seed(0)
    model = SimpleCNN().cuda().double()
    x = torch.randn(16, 1, 28, 28, device="cuda", dtype=torch.float64)
    y = torch.randint(10, (16,), device="cuda")
    want = vmap_grad(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        F.cross_entropy(model(x), y, reduction=reduction).backward()
    for name, p in model.named_parameters():
        assert p.grad1.device.type == "cuda"
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-10)

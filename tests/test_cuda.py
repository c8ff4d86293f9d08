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


@pytest.mark.parametrize("model_of", ["mlp", "positions"])
@pytest.mark.parametrize("method", ["grad1", "norms", "dp-bookkeeping"])
def test_steady_steps_wait_for_the_device_only_for_the_shared_calls_check(model_of, method):
    """torch's own count of the operations that wait for the device
    (``torch.cuda.set_sync_debug_mode``), in steady-state steps (the 5th to 7th, none
    verified): none for an MLP, one per step with position embeddings (the check of the shared
    call's per-example output-gradients: see test_host_syncs.py)."""
    import warnings

    from test_host_syncs import _loss, _mlp, _positions

    model, x, y = (_mlp if model_of == "mlp" else _positions)()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hooks = gradhooks.add_hooks(
        model, loss_reduction="mean", quantities=("grad1",) if method == "grad1" else ("norms",)
    )
    waits = []
    for step in range(1, 9):
        counted = 5 <= step <= 7
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if counted else "default")
            try:
                opt.zero_grad()
                if method == "dp-bookkeeping":
                    per = _loss(model(x), y, reduction="none")
                    gradhooks.dp_sgd_step(hooks, per, max_norm=0.5, noise_multiplier=1.0,
                                          method="bookkeeping")  # fmt: skip
                else:
                    _loss(model(x), y).backward()
                    if method == "norms":
                        hooks.norms()
                opt.step()
                hooks.clear()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if counted:
            waits += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == (0 if model_of == "mlp" else 3), waits

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import gradhooks.devices
from harness import DEVICE_LIKE

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("GRADHOOKS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
# Each of pytest-xdist's workers (addopts: one per core, at most 4) takes one thread, so that
# the workers do not share cores; a run in one process (-n 0) takes two.
torch.set_num_threads(1 if "PYTEST_XDIST_WORKER" in os.environ else min(2, torch.get_num_threads()))
if "GRADHOOKS_TEST_DEFAULT_DEVICE" in os.environ:
    # e.g. cuda: the suite with torch's default device there (tensors and modules a test makes
    # without naming a device); a test that names the CPU, or mixes in its generators, stays
    # there or fails for it
    torch.set_default_device(os.environ["GRADHOOKS_TEST_DEFAULT_DEVICE"])

if "GRADHOOKS_SUM_GRAD1_POSITIONS" in os.environ:
    # e.g. 1: every CPU Linear and convolution call takes its batch gradient from grad1
    # (gradhooks.rules.linear.many_positions), not only those with many positions
    import gradhooks

    gradhooks.TUNING.sum_grad1_positions = int(os.environ["GRADHOOKS_SUM_GRAD1_POSITIONS"])


@pytest.fixture(autouse=DEVICE_LIKE)
def device_like(monkeypatch):
    """The CPU taken for a GPU (:func:`gradhooks.devices.on_cpu`): values cost a wait to read
    back, and gradhooks takes, on CPU tensors, every path it takes on a CUDA tensor. For every
    test with ``GRADHOOKS_TEST_DEVICE_LIKE=1``; else for the tests that ask for it."""
    monkeypatch.setattr(gradhooks.devices, "on_cpu", lambda t: False)


@pytest.fixture
def dynamo():
    """``torch._dynamo``, its compiled code and counters cleared before and after the test."""
    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    try:
        yield dynamo
    finally:
        dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

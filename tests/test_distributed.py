"""torch.distributed: DDP on hooked models, DP-SGD and K-FAC across ranks.

The tests share two launches of two processes of ``distributed_worker.py`` each, with the
environment torchrun would give them (gloo backend, 127.0.0.1, a free port): each launch runs
its scenarios one after the other (each process pays the imports once), waits at most
``TIMEOUT`` seconds a scenario (then kills both), and each test asserts that both ranks passed
its scenario's own checks (the worker's docstrings say which)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="no gloo backend"
)

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = WORKER.parent.parent
WORLD = 2
TIMEOUT = 60


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The scenarios of each launch, and what it adds to the environment. FSDP's scenarios run last:
# they import FSDP2, and gradhooks looks for FSDP's modules only once they are imported
LAUNCHES = {
    "plain": (
        ["ddp_grad1", "dp_sgd", "dp_sgd_autocast", "dp_sgd_noise", "kfac", "mismatch",
         "dp_sgd_warnings", "fsdp", "dp_sgd_groups"],
        {},
    ),
    # every Linear and Conv1d call takes its batch gradient from grad1 (a _Join node)
    "grad1-positions": (["ddp_grad1", "dp_sgd"], {"GRADHOOKS_SUM_GRAD1_POSITIONS": "1"}),
}  # fmt: skip


def launch(scenarios: list[str], extra_env: dict, tmp_path: Path) -> list[tuple[int | None, str]]:
    """Run ``scenarios`` on WORLD ranks; (exit status, or None when killed at the deadline,
    output) per rank."""
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        env = {
            **os.environ,
            **extra_env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(WORLD),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *scenarios],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
    results, killed = [], set()
    deadline = time.monotonic() + TIMEOUT * len(scenarios)
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                killed.add(rank)
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append((None if rank in killed else p.returncode, log.read()))
        log.close()
    return results


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(name)``: the ranks' results of the launch ``name`` of LAUNCHES, run on first
    use."""
    done: dict[str, list[tuple[int | None, str]]] = {}

    def results(name: str) -> list[tuple[int | None, str]]:
        if name not in done:
            scenarios, extra_env = LAUNCHES[name]
            done[name] = launch(scenarios, extra_env, tmp_path_factory.mktemp(name))
            if any("address already in use" in out.lower() for _, out in done[name]):
                # the free port was taken meanwhile: once more
                done[name] = launch(scenarios, extra_env, tmp_path_factory.mktemp(name))
        return done[name]

    return results


def run(scenario: str, launches, name: str = "plain") -> None:
    assert scenario in LAUNCHES[name][0]
    for rank, (code, out) in enumerate(launches(name)):
        if all(f"rank {rank}: {s} OK" in out for s in LAUNCHES[name][0]):
            assert code == 0, f"rank {rank} failed after its checks (exit {code}):\n{out[-3000:]}"
        if f"rank {rank}: {scenario} OK" in out:
            continue
        assert code is not None, f"rank {rank} killed before {scenario} passed:\n{out[-3000:]}"
        raise AssertionError(
            f"rank {rank} ended (exit {code}) before {scenario} passed:\n{out[-3000:]}"
        )


def test_ddp_grad1_per_shard_and_allreduce_untouched(launches):
    """Hooks on the DDP wrapper, then on the inner module (one launch for both)."""
    run("ddp_grad1", launches)


def test_ddp_with_batch_gradients_from_grad1(launches):
    """Every Linear and Conv1d call takes its batch gradient from grad1 (a _Join node):
    DDP's all-reduce still sees every parameter's gradient and p.grad stays the full-batch
    gradient."""
    run("ddp_grad1", launches, "grad1-positions")


@pytest.mark.parametrize("detached", [False, True], ids=["", "detached"])
def test_dp_sgd_across_ranks_equals_one_process(launches, detached):
    """``detached``: every Linear call takes its batch gradient from grad1, also on the rank
    with no examples (whose parameters then get no gradient from the call's node)."""
    run("dp_sgd", launches, "grad1-positions" if detached else "plain")


def test_dp_sgd_under_autocast_and_grad_scaler(launches):
    run("dp_sgd_autocast", launches)


def test_dp_sgd_noise_added_once(launches):
    run("dp_sgd_noise", launches)


def test_kfac_factors_reduced_across_ranks(launches):
    run("kfac", launches)


def test_fsdp2_dp_step_equals_one_process(launches):
    run("fsdp", launches)


def test_group_clipped_dp_sgd_across_ranks_and_fsdp2_equals_one_process(launches):
    run("dp_sgd_groups", launches)


def test_dp_sgd_across_ranks_warns_of_what_it_does_not_protect(launches):
    """Parameters outside the hooks, and passages taken as shared by every question: each
    rank warns once (``distributed_worker.dp_sgd_warnings``)."""
    run("dp_sgd_warnings", launches)


def test_different_models_on_ranks_raise(launches):
    run("mismatch", launches)


def test_torchrun_example(tmp_path):
    """examples/distributed_dp_sgd.py under torchrun (``python -m torch.distributed.run``):
    trains, the replicas stay equal (the example asserts it), and it learns."""
    log = tmp_path / "torchrun.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", str(ROOT / "examples" / "distributed_dp_sgd.py"),
        "--steps", "40",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
            proc.wait()
            pytest.fail(f"torchrun killed after {TIMEOUT} s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    acc = float(text.split("accuracy ")[-1].split()[0])
    assert acc > 0.8, f"DP-SGD across 2 processes did not learn: accuracy {acc:.3f}\n{text}"

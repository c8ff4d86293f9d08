"""``python -m bench.module_cost``: the stack it times, the fit, and its output, run tiny."""

from __future__ import annotations

import json

import pytest
import torch

from bench import module_cost


@pytest.mark.parametrize(("n", "k"), [(1, 0), (2, 3), (3, 8)])
def test_a_block_makes_k_torch_calls_besides_its_linear(n, k):
    """The stack's plain forward calls ``N · (k + 1)`` torch functions, and each block's
    values stay bounded (the scale and the shift alternate)."""
    model = module_cost.stack(n, k)
    x = torch.randn(4, 8)
    assert module_cost.torch_calls(model, x) == n * (k + 1)
    out = module_cost.stack(1, 64)(x)
    assert out.abs().max() < 10


def test_the_fit_recovers_the_costs_it_is_given():
    """Medians built from known costs give those costs back, residual 0."""
    rows = [
        {"n": n, "k": k, "median_us": {"plain": 50 + n * (7 + 0.5 * k)}}
        for n in (2, 8)
        for k in (0, 4, 16, 64)
    ]
    got = module_cost.fit(rows, "plain")
    assert got["fixed_us"] == pytest.approx(50)
    assert got["per_module_us"] == pytest.approx(7)
    assert got["per_call_us"] == pytest.approx(0.5)
    assert got["max_rel_residual"] == pytest.approx(0, abs=1e-9)


def test_runs_tiny_and_writes_the_fields(tmp_path):
    threads = torch.get_num_threads()
    argv = ["--ns", "1,2", "--ks", "0,2", "--rounds", "1", "--reps", "2", "--out", str(tmp_path)]
    assert module_cost.main(argv) == 0
    assert torch.get_num_threads() == threads
    data = json.loads((tmp_path / "module-cost-cpu.json").read_text())
    assert [(r["n"], r["k"]) for r in data["rows"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for r in data["rows"]:
        assert r["torch_calls_forward"] == r["n"] * (r["k"] + 1)
        assert set(r["median_us"]) == {"plain", "grad1", "norms"}
        assert all(t > 0 for t in r["median_us"].values())
        # the tracker sees at least every torch call of the forward
        assert r["tracker_calls_step"] >= r["torch_calls_forward"]
    assert set(data["fit"]) == {"plain", "grad1", "norms", "grad1 - plain", "norms - plain"}
    for f in data["fit"].values():
        assert {"fixed_us", "per_module_us", "per_call_us"} <= set(f)
    md = (tmp_path / "module-cost-cpu.md").read_text()
    assert "| grad1 - plain |" in md and "per hooked module (us)" in md


def test_refuses_a_fit_it_cannot_make(tmp_path):
    with pytest.raises(SystemExit, match="two values"):
        module_cost.main(["--ns", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown methods"):
        module_cost.main(["--methods", "plain,backpack", "--out", str(tmp_path)])


def test_the_compared_designs_run_and_agree_with_grad1(tmp_path):
    """The floor of a design by hooks, with and without a mode that sees every torch function,
    and Opacus' hooks where installed: each measured after its per-example gradients were
    checked against grad1's."""
    methods = ["plain", "floor", "floor+mode", "grad1"]
    try:
        import opacus  # noqa: F401

        methods.append("opacus")
    except ImportError:
        pass
    argv = ["--ns", "1,2", "--ks", "0,2", "--rounds", "1", "--reps", "1",
            "--methods", ",".join(methods), "--out", str(tmp_path)]  # fmt: skip
    assert module_cost.main(argv) == 0
    data = json.loads((tmp_path / "module-cost-cpu.json").read_text())
    for r in data["rows"]:
        assert set(r["median_us"]) == set(methods)
    assert {"floor - plain", "floor+mode - plain"} <= set(data["fit"])


def test_a_compared_design_that_differs_from_grad1_is_not_measured(monkeypatch):
    """The check before the timing fails where the floor's gradients are not grad1's."""
    forward = module_cost.Floor._forward

    def doubled(module, args, output):
        forward(module, (args[0] * 2,), output)

    monkeypatch.setattr(module_cost.Floor, "_forward", staticmethod(doubled))
    with pytest.raises(RuntimeError, match="floor's per-example gradients differ"):
        module_cost.measure([1, 2], [0, 1], rounds=1, reps=1, methods=("plain", "floor", "grad1"))


def test_the_check_without_grad1_uses_the_loop():
    """Without grad1 among the methods, the floor is checked against a per-example loop."""
    config = module_cost.Config(2, 1, 8, 4, ("plain", "floor"))
    try:
        config.reset("floor")
        config.step("floor")
        module_cost.check(config, ("plain", "floor"))
        config.models["floor"][0].linear.weight.grad1 *= 2
        with pytest.raises(RuntimeError, match="floor's"):
            module_cost.check(config, ("plain", "floor"))
    finally:
        config.close()

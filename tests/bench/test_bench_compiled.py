"""fxckpt under torch.compile in the benchmark: the ``fxckpt_compiled @compile b=0.5`` row, timed
by turns with the ``compile`` peer, each compiled under its own ``activation_memory_budget``."""

from __future__ import annotations

from statistics import median
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config

from benchmarks.methods import prepare
from benchmarks.models import spec_for
from benchmarks.runner import BenchOptions, configurations, matched_configs
from benchmarks.targets import check_targets

MiB = 2**20


def _row(method: str, budget: Any, rss: float, ratio: float, **extra: Any) -> dict[str, Any]:
    label = extra.pop("label", method if budget is None else f"{method} b={budget:g}")
    return {"model": "gpt2", "method": method, "budget": budget, "label": label, "status": "ok",
            "rss_bytes": int(rss * MiB), "time_ratio": ratio, **extra}


def test_the_compiled_row_is_made_only_for_compile_at_the_speed_targets_budget() -> None:
    opts = BenchOptions(models=("gpt2",), methods=("fxckpt_compiled", "compile"),
                        budgets=(0.25, 0.5))
    configs = configurations(opts)
    assert [c.label for c in configs] == ["unmodified", "compile b=0.25", "compile b=0.5"]
    peaks = {"unmodified": 100, "compile b=0.25": 70, "compile b=0.5": 50}
    memory = {c: {"status": "ok", "rss_bytes": int(peaks[c.label] * MiB)} for c in configs}
    got = [(c.method, c.budget, c.label, c.paired) for c in matched_configs(configs, memory, True)]
    assert got == [
        ("fxckpt", 70 * MiB, "fxckpt @compile b=0.25", None),
        ("fxckpt_compiled", 50 * MiB, "fxckpt_compiled @compile b=0.5", ("compile", 0.5)),
        ("fxckpt", 50 * MiB, "fxckpt @compile b=0.5", None),
    ]
    assert all(c.method == "fxckpt" for c in matched_configs(configs, memory))  # not asked for


def test_the_compiled_row_counts_for_budget_speed_and_pareto_but_not_prediction() -> None:
    compiled = _row("fxckpt_compiled", 50 * MiB, 35, 1.10, match="compile b=0.5",
                    label="fxckpt_compiled @compile b=0.5", peer_ratio=0.93,
                    plan_peak=50 * MiB)  # the eager plan's peak: not what ran
    rows = [_row("unmodified", None, 100, 1.0),
            _row("fxckpt", 50 * MiB, 50, 1.30, match="compile b=0.5",
                 label="fxckpt @compile b=0.5", plan_peak=50 * MiB),
            compiled, _row("compile", 0.5, 50, 1.18)]
    checks = check_targets(rows, [])
    held = [(c.subject, c.verdict) for c in checks if c.target == "budget held"]
    assert held == [("gpt2 fxckpt @compile b=0.5", "PASS"),
                    ("gpt2 fxckpt_compiled @compile b=0.5", "PASS")]
    assert [c.subject for c in checks if c.target == "prediction"] == [
        "gpt2 fxckpt @compile b=0.5"]
    (speed,) = [c for c in checks if c.target == "speed at the peer's peak"]
    # timed by turns with the peer: 0.93, where the ratio of ratios would say 1.10 / 1.18
    assert speed.verdict == "PASS" and speed.detail.startswith(
        "fxckpt_compiled @compile b=0.5: 35.0 MiB (0.700x the peer's 50.0 MiB)")
    assert "fxckpt/peer time = 0.930 (timed by turns with the peer)" in speed.detail
    (dominance,) = [c for c in checks if c.target == "Pareto dominance"]
    assert dominance.detail.startswith("fxckpt_compiled @compile b=0.5: 35.0 MiB")
    # against an eager peer only eager points count: compiling fxckpt and not the peer would
    # compare inductor's kernels with eager ones
    eager_peer = _row("checkpoint_per_block", None, 40, 1.50)
    checks = check_targets(rows[:3] + [eager_peer], [])
    (speed,) = [c for c in checks if c.target == "speed at the peer's peak"]
    (dominance,) = [c for c in checks if c.target == "Pareto dominance"]
    assert speed.verdict == dominance.verdict == "FAIL"
    assert "no timed fxckpt point at or below 1.05 x the peer's peak 40.0 MiB" in speed.detail
    assert "(lowest: 50.0 MiB)" in dominance.detail  # the compiled 35 MiB is not offered
    over = dict(compiled, rss_bytes=53 * MiB)  # 1.06x its budget
    held = [c for c in check_targets([rows[0], over], []) if c.target == "budget held"]
    assert [c.verdict for c in held] == ["FAIL"] and "1.060x the budget" in held[0].detail


def test_each_compiled_module_is_partitioned_under_its_own_memory_budget() -> None:
    """A time child prepares the compile peer (0.5) and fxckpt's compiled module (torch's 1.0),
    then calls them by turns: each must be compiled with its own setting, whatever the global."""
    seen: list[float] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(functorch_config.activation_memory_budget)
        return gm.forward

    spec = spec_for("mlp")
    built = []
    for method, budget in (("compile", 0.5), ("fxckpt_compiled", 0.5)):
        torch.manual_seed(0)
        model, inputs, loss = spec.build(spec.quick)
        module, facts = prepare(method, model, inputs, spec, budget, compile_backend=backend,
                                time_solver=False, loss=loss)
        built.append((module, inputs, loss, model))
    with functorch_config.patch(activation_memory_budget=0.3):
        for module, inputs, loss, _ in built:
            loss(module(*inputs)).backward()
        assert functorch_config.activation_memory_budget == 0.3
    assert seen == [0.5, 1.0]
    assert "torch.compile(backend=" in facts["detail"] and facts["segments"] >= 1
    # the compiled transformed module trains the model as the eager one does
    torch.manual_seed(0)
    model, inputs, loss = spec.build(spec.quick)
    loss(model(*inputs)).backward()
    for eager, compiled in zip(model.parameters(), built[1][3].parameters()):
        assert compiled.grad is not None and torch.allclose(eager.grad, compiled.grad, atol=1e-6)


@pytest.mark.slow  # compiles the quick MLP with inductor in fresh processes: about 1 min
def test_a_quick_run_measures_the_compiled_row_and_times_it_with_the_peer() -> None:
    from benchmarks.runner import run_bench

    opts = BenchOptions(quick=True, models=("mlp",), methods=("fxckpt_compiled", "compile"),
                        budgets=(0.5,), repeats=2, scaling_layers=())
    result = run_bench(opts)
    rows = {r["label"]: r for r in result["rows"]}
    peer = rows["compile b=0.5"]
    matched = rows["fxckpt_compiled @compile b=0.5"]
    assert matched["budget"] == peer["rss_bytes"] and matched["paired_with"] == "compile b=0.5"
    # At the quick size compile's peak may be below any plan's: then the matched row is
    # infeasible and runs again at the minimum it states, still timed by turns with the peer.
    (row,) = [r for r in result["rows"]
              if r["method"] == "fxckpt_compiled" and r["status"] == "ok"]
    if matched["status"] == "infeasible":
        assert row["label"] == "fxckpt_compiled @minimum of @compile b=0.5"
        assert row["budget"] == matched["min_budget"] and row["paired_with"] == "compile b=0.5"
    assert row["tracked_bytes"] is None and "dynamo skips" in row["tracked_error"]
    assert row["peer_ratio"] == pytest.approx(
        median(row["step_samples"]) / median(row["peer_samples"]))
    assert row["rss_bytes"] > 0 and row["segments"] >= 1
    # compared with the peer by the ratio timed by turns in one child
    from benchmarks.targets import _how, versus

    assert _how(row, peer) == " (timed by turns with the peer)"
    assert versus(row, peer) == row["peer_ratio"]
    # the Pareto check uses it where the row is within the peer's memory; at the quick size
    # (a peak of 1-2 MiB) its RSS can land over the peer's by more than the noise, and then
    # no point fits and the check says so
    (dominance,) = [c for c in check_targets(result["rows"], []) if c.target == "Pareto dominance"
                    and c.subject == "mlp compile b=0.5"]
    assert (dominance.detail.startswith(f"{row['label']}: ")
            and "(timed by turns with the peer)" in dominance.detail) or \
        dominance.detail.startswith("no fxckpt point at or below the peer's peak")

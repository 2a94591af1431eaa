"""Tests for benchmarks/: the quick run's report, error rows for failing peers, the targets."""

from __future__ import annotations

import json
import os
from statistics import median
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import (
    BenchOptions,
    check_targets,
    configurations,
    prepare,
    render_markdown,
    run_bench,
)
from benchmarks.__main__ import main
from benchmarks.child import solve_scaling
from benchmarks.methods import CheckpointedChain
from benchmarks.models import MODELS, spec_for
from benchmarks.report import machine_info
from benchmarks.targets import timing_noise
from benchmarks.runner import (NOISE_GROUPS, Config, _in_report_order, _kwargs, matched_configs,
                                 minimum_configs)

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
ROW_KEYS = {"model", "method", "budget", "label", "status"}
MEASURED_KEYS = {
    "rss_bytes",
    "rss_samples",
    "tracked_bytes",
    "step_s",
    "base_step_s",
    "time_ratio",
    "peak_ratio",
}


@pytest.mark.slow  # ten fresh Python processes: 30-50 s on a shared 2-core machine
def test_quick_run_writes_markdown_and_json_with_every_row(tmp_path: Path) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--models",
            "mlp",
            "--methods",  # the op-level peers are n/a for the MLP (tests/bench/test_bench_sac.py)
            "fxckpt,checkpoint_per_block,checkpoint_sequential,compile",
            "--scaling-layers",
            "",
            "--repeats",
            "2",
            "--jobs",
            "3",
            "--no-match-peers",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    labels = [r["label"] for r in data["rows"]]
    assert labels == [
        "unmodified",
        "fxckpt b=0.5",
        "checkpoint_per_block",
        "checkpoint_sequential",
        "compile b=0.5",
    ]
    for row in data["rows"]:
        assert ROW_KEYS <= set(row) and row["status"] == "ok", row
        assert MEASURED_KEYS <= set(row), row
        assert row["rss_bytes"] > 0 and row["step_s"] > 0
    base, fx, compiled = data["rows"][0], data["rows"][1], data["rows"][4]
    steps, base_steps = base["step_samples"], base["base_samples"]  # --repeats 2: 2 pairs a group
    assert len(base["group_ratios"]) == NOISE_GROUPS and len(steps) == 2 * NOISE_GROUPS
    assert base["time_ratio"] == pytest.approx(median(steps) / median(base_steps))
    assert base["group_ratios"][0] == pytest.approx(median(steps[:2]) / median(base_steps[:2]))
    assert "torch.compile(backend='inductor')" in compiled["detail"] and "group_ratios" not in fx
    assert fx["predicted_peak"] > 0 and fx["budget_bytes"] > 0 and fx["solve_s"] >= 0
    assert fx["plan_peak"] == fx["verified_peak"] > 0 and fx["eager_plan_peak"] > 0
    assert fx["plan_over_measured"] == pytest.approx(fx["plan_peak"] / fx["rss_bytes"])
    assert data["machine"]["cores"] == os.cpu_count() and data["machine"]["threads"] == 1
    assert data["scaling"] == []
    assert {t["verdict"] for t in data["targets"]} <= {"PASS", "FAIL", "SKIP"}

    md = (tmp_path / "benchmarks.md").read_text()
    assert (
        "## Machine" in md and data["machine"]["cpu"] in md and f"torch {torch.__version__}" in md
    )
    for label in labels:
        assert f"| {label} |" in md
    assert "## Targets" in md and "## Solver alone" not in md
    assert "Timing noise " in md and "mlp ±" in md
    assert md.count("budget held") == 1 and "Pareto dominance" in md
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout


def test_a_failing_compile_backend_becomes_an_error_row(tmp_path: Path) -> None:
    opts = BenchOptions(quick=True, models=("mlp",), methods=("compile",), budgets=(0.5,),
                        repeats=1, scaling_layers=(), compile_backend="no_such_backend")
    result = dict(run_bench(opts), machine=machine_info())
    base, compiled = result["rows"]
    assert base["method"] == "unmodified" and base["status"] == "ok" and base["step_s"] > 0
    assert compiled["status"] == "error" and "no_such_backend" in compiled["error"]
    assert "step_s" not in compiled  # its timing child was not run
    checks = check_targets(result["rows"], result["scaling"])
    peer = [c for c in checks if c.target == "Pareto dominance"]
    assert [c.verdict for c in peer] == ["SKIP"] and "no_such_backend" in peer[0].detail
    md = render_markdown(result, checks)
    assert "| compile b=0.5 | — |" in md and "**error**: " in md


@pytest.mark.slow  # five fresh Python processes: 20-40 s
def test_an_infeasible_budget_is_run_again_at_its_stated_minimum_and_measured() -> None:
    opts = BenchOptions(quick=True, models=("mlp",), methods=("fxckpt",), budgets=(0.2,),
                        repeats=1, scaling_layers=(), match_peers=False)
    base, infeasible, retry = run_bench(opts)["rows"]
    assert infeasible["status"] == "infeasible" and infeasible["min_budget"] > 0
    assert "BudgetInfeasibleError" in infeasible["error"] and "step_s" not in infeasible
    assert (retry["label"], retry["minimum_of"], retry["budget"]) == (
        "fxckpt @minimum of b=0.2", "fxckpt b=0.2", infeasible["min_budget"])
    assert retry["status"] == "ok" and retry["rss_bytes"] > 0 and retry["step_s"] > 0
    # The stated minimum is a verified figure; the plan made for it is verified under it.
    assert retry["verified_peak"] is not None
    assert retry["plan_peak"] == retry["verified_peak"] <= infeasible["min_budget"]
    (check,) = _by_target(check_targets([base, infeasible, retry], []), "budget held")
    assert check.passed == (retry["rss_bytes"] <= 1.05 * infeasible["min_budget"])
    assert f"with budget={infeasible['min_budget']}: measured" in check.detail


def _row(
    model: str, method: str, budget: float | None, rss: float, time_ratio: float, **extra: Any
) -> dict:
    label = method if budget is None else f"{method} b={budget:g}"
    return {"model": model, "method": method, "budget": budget, "label": label, "status": "ok",
            "rss_bytes": int(rss * MiB), "time_ratio": time_ratio, **extra}


def _by_target(checks: list, target: str) -> list:
    return [c for c in checks if c.target == target]


def test_solve_scaling_times_the_solver_per_layer_count() -> None:
    pytest.importorskip("transformers")
    result = solve_scaling([1, 2], [0.5], repeats=1)
    rows = result["rows"]
    assert [(r["layers"], r["status"], r["budget"]) for r in rows] == [
        (1, "ok", 0.5),
        (2, "ok", 0.5),
    ]
    assert rows[0]["ops"] < rows[1]["ops"] and all(
        r["solve_s"] > 0 and isinstance(r["feasible"], bool) for r in rows
    )


def test_targets_check_budget_prediction_and_dominance_with_their_numbers() -> None:
    rows = [
        _row("m", "unmodified", None, 100, 1.0),
        _row(
            "m",
            "fxckpt",
            0.25,
            27,
            1.20,
            plan_peak=int(25 * MiB),
            predicted_peak=int(31 * MiB),
            budget_bytes=int(25 * MiB),
            eager_plan_peak=int(100 * MiB),
        ),
        _row(
            "m",
            "fxckpt",
            0.5,
            49,
            1.10,
            plan_peak=int(40 * MiB),
            predicted_peak=int(40 * MiB),
            budget_bytes=int(50 * MiB),
            eager_plan_peak=int(100 * MiB),
        ),
        _row("m", "checkpoint_per_block", None, 30, 1.30),
        _row("m", "compile", 0.25, 50, 1.05),
        _row("m", "checkpoint_sequential", None, 20, 1.25),
    ]
    checks = check_targets(rows, [])
    assert [c.verdict for c in _by_target(checks, "budget held")] == [
        "FAIL",
        "PASS",
    ]  # 27 > 1.05 * 25
    assert [c.verdict for c in _by_target(checks, "prediction")] == [
        "PASS",
        "FAIL",
        "PASS",
    ]  # 40 vs 49: -18%
    first = _by_target(checks, "prediction")[0].detail
    # the plan's stated (verified) peak is checked; the simulator's is shown beside it
    assert first == ("plan states 25.0 MiB vs measured 27.0 MiB (-7.4%); "
                     "the simulator alone said 31.0 MiB (+14.8%)")
    assert "simulator" not in _by_target(checks, "prediction")[1].detail  # the same figure
    dom = _by_target(checks, "Pareto dominance")
    assert [c.subject for c in dom] == [
        "m checkpoint_per_block",
        "m compile b=0.25",
        "m checkpoint_sequential",
    ]
    assert [c.verdict for c in dom] == ["PASS", "FAIL", "FAIL"]
    # the unmodified row's one ratio 1.00 is the noise: 0%
    # 1.20 / 1.30, at 27 MiB <= 30 MiB
    assert "fxckpt/peer time = 0.923, limit 1 + 0.0%" in dom[0].detail
    assert "faster beyond the noise" in dom[0].detail
    assert "fxckpt/peer time = 1.048" in dom[1].detail  # 1.10 / 1.05 at 49 MiB <= 50 MiB
    assert "slower beyond the noise" in dom[1].detail
    assert ("no fxckpt point at or below the peer's peak 20.0 MiB + its memory noise "
            "(lowest: 27.0 MiB)") in dom[2].detail


def _infeasible(budget: float, min_mib: float) -> dict:
    return {"model": "m", "method": "fxckpt", "budget": budget, "label": f"fxckpt b={budget:g}",
            "status": "infeasible", "error": "BudgetInfeasibleError: ...",
            "min_budget": int(min_mib * MiB)}


def _at_minimum(of: dict, status: str = "ok", rss: float = 0.0) -> dict:
    row = dict(_row("m", "fxckpt", None, rss, 1.3, minimum_of=of["label"], status=status),
               budget=of["min_budget"], label=f"fxckpt @minimum of b={of['budget']:g}")
    failed = dict(row, error="BudgetInfeasibleError: again", rss_bytes=None)
    return row if status == "ok" else failed


def test_an_infeasible_budget_passes_only_if_its_stated_minimum_is_held_when_measured() -> None:
    held, broken, again, unmeasured = (_infeasible(b, 30) for b in (0.1, 0.15, 0.2, 0.25))
    rows = [
        _row("m", "unmodified", None, 100, 1.0),
        held,
        broken,
        again,
        unmeasured,
        _at_minimum(held, rss=31.4),
        _at_minimum(broken, rss=31.6),
        _at_minimum(again, "infeasible"),
        {
            "model": "m",
            "method": "fxckpt",
            "budget": 0.5,
            "label": "fxckpt b=0.5",
            "status": "error",
            "error": "KeyError: 'kind'",
        },
    ]
    checks = _by_target(check_targets(rows, []), "budget held")  # none for the @minimum rows
    assert [(c.subject, c.verdict) for c in checks] == [
        ("m fxckpt b=0.1 (infeasible)", "PASS"), ("m fxckpt b=0.15 (infeasible)", "FAIL"),
        ("m fxckpt b=0.2 (infeasible)", "FAIL"), ("m fxckpt b=0.25 (infeasible)", "FAIL"),
        ("m fxckpt b=0.5", "FAIL")]
    assert "states a minimum of 30.0 MiB (31457280 bytes)" in checks[0].detail
    assert ("measured 31.4 MiB vs 1.05 x 30.0 MiB = 31.5 MiB: 1.047x the stated minimum"
            in checks[0].detail)
    assert "1.053x the stated minimum" in checks[1].detail
    assert "with budget=31457280: infeasible: BudgetInfeasibleError: again" in checks[2].detail
    assert checks[3].detail.endswith("that minimum was not measured")
    assert "KeyError" in checks[4].detail
    # the run at the minimum is one more fxckpt point: its prediction is checked
    predictions = _by_target(check_targets(rows, []), "prediction")
    assert "m fxckpt @minimum of b=0.1" in [c.subject for c in predictions]


def test_infeasible_rows_get_a_run_at_their_stated_minimum_in_bytes() -> None:
    opts = BenchOptions(models=("mlp",), methods=("fxckpt", "checkpoint_per_block"),
                        budgets=(0.1, 0.5))
    configs = configurations(opts)
    memory = {c: {"status": "ok", "rss_bytes": MiB} for c in configs}
    memory[configs[1]] = {"status": "infeasible", "error": "...", "min_budget": 3 * MiB}
    (retry,) = minimum_configs(configs, memory)
    assert (retry.method, retry.budget, retry.minimum_of, retry.label) == (
        "fxckpt", 3 * MiB, "fxckpt b=0.1", "fxckpt @minimum of b=0.1")
    assert isinstance(retry.budget, int)
    assert _kwargs(retry, opts, "measure_memory")["time_solver"] is False
    peer = Config("mlp", "fxckpt", 2 * MiB, match="checkpoint_per_block")
    assert [c.label for c in _in_report_order(configs + [peer, retry])] == [
        "unmodified", "fxckpt b=0.1", "fxckpt @minimum of b=0.1", "fxckpt b=0.5",
        "fxckpt @checkpoint_per_block", "checkpoint_per_block"]
    # a matched row can be infeasible too: its minimum is measured and follows it
    memory[peer] = {"status": "infeasible", "error": "...", "min_budget": 4 * MiB}
    (again,) = minimum_configs([peer], memory)
    assert again.label == "fxckpt @minimum of @checkpoint_per_block" and again.budget == 4 * MiB
    assert [c.label for c in _in_report_order([again, peer, configs[0]])] == [
        "unmodified", "fxckpt @checkpoint_per_block", "fxckpt @minimum of @checkpoint_per_block"]


def test_only_the_unmodified_model_is_timed_in_noise_groups() -> None:
    opts = BenchOptions(models=("mlp",), methods=("fxckpt",), budgets=(0.5,))
    base, fx = configurations(opts)
    assert _kwargs(base, opts, "measure_time")["groups"] == NOISE_GROUPS
    assert "groups" not in _kwargs(base, opts, "measure_memory")
    assert "groups" not in _kwargs(fx, opts, "measure_time")


def test_solver_targets_use_time_limit_and_log_log_slope() -> None:
    scaling = [{"layers": 12, "status": "ok", "ops": 600, "solve_s": 0.5, "budget": 0.5},
               {"layers": 48, "status": "ok", "ops": 2400, "solve_s": 2.2, "budget": 0.5},
               {"layers": 192, "status": "ok", "ops": 9600, "solve_s": 8.4, "budget": 0.5}]
    checks = check_targets([_row("gpt2", "unmodified", None, 10, 1.0)], scaling)
    (solve,) = _by_target(checks, "solve time < 1 s")
    (slope,) = _by_target(checks, "linear scaling")
    assert (
        solve.verdict == "PASS"
        and slope.verdict == "PASS"
        and "consecutive sizes 1.07, 0.97 " in slope.detail
    )
    scaling[1]["solve_s"] = 4.0  # 12 -> 48 layers: log(8)/log(4) = 1.5, though 12 -> 192 is 1.02
    assert _by_target(check_targets([], scaling), "linear scaling")[0].verdict == "FAIL"


def test_each_peer_that_saved_memory_gets_an_fxckpt_row_with_its_peak_as_budget() -> None:
    opts = BenchOptions(
        models=("mlp",),
        methods=("checkpoint_per_block", "checkpoint_sequential", "compile"),
        budgets=(0.25, 0.5),
    )
    configs = configurations(opts)
    peaks = {"unmodified": 100, "checkpoint_per_block": 50, "checkpoint_sequential": 50.4,
             "compile b=0.25": 120, "compile b=0.5": 60}
    memory = {c: {"status": "ok", "rss_bytes": int(peaks[c.label] * MiB)} for c in configs}
    matched = matched_configs(configs, memory)
    # sequential is within 1% of per-block (shares its row); compile b=0.25 saved nothing
    assert [(c.method, c.budget, c.match, c.label) for c in matched] == [
        ("fxckpt", 50 * MiB, "checkpoint_per_block", "fxckpt @checkpoint_per_block"),
        ("fxckpt", 60 * MiB, "compile b=0.5", "fxckpt @compile b=0.5"),
    ]
    rows = [
        {
            "model": "mlp",
            "method": "unmodified",
            "budget": None,
            "label": "unmodified",
            "status": "ok",
            "rss_bytes": 100 * MiB,
        },
        {
            "model": "mlp",
            "method": "fxckpt",
            "budget": 50 * MiB,
            "match": "checkpoint_per_block",
            "label": "fxckpt @checkpoint_per_block",
            "status": "ok",
            "rss_bytes": int(53 * MiB),
        },
    ]
    (held,) = _by_target(check_targets(rows, []), "budget held")
    assert held.verdict == "FAIL" and "1.060x the budget" in held.detail


def test_configurations_run_budgeted_methods_per_budget_and_unmodified_first() -> None:
    opts = BenchOptions(
        models=("mlp", "gpt2"), methods=("compile", "checkpoint_per_block"), budgets=(0.25, 0.75)
    )
    got = [(c.model, c.method, c.budget) for c in configurations(opts)]
    assert got[:4] == [("mlp", "unmodified", None), ("mlp", "checkpoint_per_block", None),
                       ("mlp", "compile", 0.25), ("mlp", "compile", 0.75)]
    assert len(got) == 8


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_checkpoint_peers_keep_the_models_gradients(name: str) -> None:
    spec = spec_for(name)
    grads = []
    for method in ("unmodified", "checkpoint_per_block", "checkpoint_sequential"):
        torch.manual_seed(0)
        model, inputs, loss = spec.build(spec.quick)
        module, _ = prepare(method, model, inputs, spec, None)
        loss(module(*inputs)).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


def test_checkpoint_sequential_wraps_hugging_face_blocks_as_one_chain() -> None:
    pytest.importorskip("transformers")
    spec = MODELS["gpt2"]
    torch.manual_seed(0)
    model, inputs, loss = spec.build(spec.quick)
    module, facts = prepare("checkpoint_sequential", model, inputs, spec, None)
    (chain,) = model.transformer.h
    assert isinstance(chain, CheckpointedChain) and len(chain.blocks) == spec.quick["layers"]
    loss(module(*inputs)).backward()
    assert facts["segments"] == 1 and model.transformer.wte.weight.grad is not None


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--models", "nope"], ["--budgets", "1.5"],
                                  ["--methods", "magic"], ["--budgets", "a,b"]])
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: python -m benchmarks" in capsys.readouterr().err


def test_dominance_needs_no_more_memory_and_no_slower_time_beyond_the_noise() -> None:
    noise = [1.01, 0.97, 1.02, 1.00, 0.99]  # 3%
    base = _row("m", "unmodified", None, 100, 1.01, group_ratios=noise)
    ours = [_row("m", "fxckpt", 0.4, 40, 1.20, rss_samples=[40 * MiB, 40 * MiB]),
            _row("m", "fxckpt", 0.45, 45.1, 1.00, rss_samples=[int(45.1 * MiB)] * 2)]
    peers = [_row("m", "checkpoint_per_block", None, 41, 1.18),  # 1.20 / 1.18 = 1.017: a tie
             _row("m", "checkpoint_sequential", None, 42, 1.40),  # 1.20 / 1.40: faster
             _row("m", "compile", 0.5, 40, 1.15),  # 1.20 / 1.15 = 1.043: slower beyond 3%
             _row("m", "compile", 0.6, 45, 1.05),  # the 1.00x point uses 0.1 MiB more: not it
             _row("m", "compile", 0.7, 45, 1.05, rss_samples=[int(44.9 * MiB), int(45.2 * MiB)])]
    dom = _by_target(check_targets([base, *ours, *peers], []), "Pareto dominance")
    assert [c.verdict for c in dom] == ["PASS", "PASS", "FAIL", "FAIL", "PASS"]
    assert ("fxckpt/peer time = 1.017, limit 1 + 3.0% (timing noise of 5 self-ratios): "
            "equal within the noise") in dom[0].detail
    assert "faster beyond the noise" in dom[1].detail
    assert "fxckpt/peer time = 1.043" in dom[2].detail
    assert "slower beyond the noise" in dom[2].detail
    assert dom[3].detail.startswith("fxckpt b=0.4: 40.0 MiB, 1.20x time")
    assert "(memory noise 0 KiB)" in dom[3].detail
    # the peer's own RSS samples spread by 0.3 MiB: 45.1 MiB is within that memory noise
    assert dom[4].detail.startswith("fxckpt b=0.45: 45.1 MiB, 1.00x time")
    assert "(memory noise 307 KiB)" in dom[4].detail
    assert timing_noise([base], "m") == (pytest.approx(0.03), 5)
    assert timing_noise([base], "other") is None


def test_dominance_without_a_measured_noise_uses_none() -> None:
    rows = [_row("m", "fxckpt", 0.5, 40, 1.19), _row("m", "checkpoint_per_block", None, 41, 1.18)]
    (dom,) = _by_target(check_targets(rows, []), "Pareto dominance")
    assert dom.verdict == "FAIL" and "limit 1 + 0.0% (timing noise not measured)" in dom.detail


def test_a_peer_shares_a_matched_row_only_if_that_budget_is_not_above_its_peak() -> None:
    opts = BenchOptions(models=("mlp",), methods=("checkpoint_per_block", "checkpoint_sequential"))
    configs = configurations(opts)
    peaks = {"unmodified": 100, "checkpoint_per_block": 50, "checkpoint_sequential": 49.8}
    memory = {c: {"status": "ok", "rss_bytes": int(peaks[c.label] * MiB)} for c in configs}
    assert [c.budget for c in matched_configs(configs, memory)] == [50 * MiB, int(49.8 * MiB)]


def test_large_tier_rows_report_three_peaks_and_check_the_targets() -> None:
    from benchmarks import large
    from benchmarks.models import MODELS

    sizes = MODELS["mlp"].quick
    eager = large.measure_row("mlp", "unmodified", None, repeats=1, sizes=sizes)
    planned = large.measure_row("mlp", "fxckpt", 0.6, repeats=1, sizes=sizes)
    # In this process the RSS protocol has no MALLOC_MMAP_THRESHOLD_: measured is only present.
    assert eager["verified"] > planned["verified"] > 0 and len(planned["samples"]) == 1
    assert planned["simulated"] > 0 and planned["verified"] <= planned["budget_bytes"]
    infeasible = large.measure_row("mlp", "fxckpt", 0.01, repeats=1, sizes=sizes)
    assert infeasible["infeasible"] and infeasible["min_budget"] > 0
    assert eager["measured"] >= 0 and planned["measured"] >= 0
    # The report and the checks on known figures (the in-process RSS may not rise at all).
    eager["measured"], planned["measured"] = eager["verified"], int(planned["verified"] / 0.9)
    text = large.report([eager, planned, infeasible])
    assert "| mlp | fxckpt | 0.6 |" in text and "infeasible: minimum" in text
    assert "| 1.000 |" in text and "| 0.900 |" in text
    lines = large.checks([eager, planned, infeasible])
    over = planned["measured"] / planned["budget_bytes"]
    assert lines[:3] == [
        "- ok: mlp unmodified : verified / measured = 1.000",
        "- MISSED: mlp fxckpt 0.6: verified / measured = 0.900",
        f"- {'ok' if over <= 1.05 else 'MISSED'}: mlp fxckpt 0.6: measured / budget = {over:.3f}",
    ] and lines[3].startswith("- mlp fxckpt 0.01: infeasible")
    planned["measured"] = 0
    assert large.checks([planned])[0] == "- MISSED: mlp fxckpt 0.6: no measured peak"
    assert "| - |" in large.report([planned])

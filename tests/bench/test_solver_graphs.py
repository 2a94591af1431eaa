"""benchmarks.solver_graphs: the solver where many values stay live, checked against the exact
optimum where the exact search finishes."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.solver_graphs import EXACT_GRAPHS, GRAPHS, exact, render, run
from benchmarks.solver_targets import EXACT_AGREEMENT, graph_checks


def _row(**extra: Any) -> dict[str, Any]:
    row = {"status": "ok", "graph": "dense-16", "ops": 51, "fraction": 0.5, "solve_s": 1.5,
           "traced_bytes": 2**23, "rss_growth_bytes": 2**24, "gave_up": [210649, 512],
           "cost": 1.538e8, "lower_bound": 1.538e8, "gap": 0.0, "fits": True}
    return dict(row, **extra)


def _agreement(checks: list[Any]) -> list[Any]:
    return [c for c in checks if c.target.startswith("within 2% of the exact optimum")]


def test_a_plan_is_checked_against_the_optimum_where_it_was_found() -> None:
    within = _row(exact_cost=1.538e8 / 1.01, exact_s=0.4, exact_rss_bytes=2**28,
                  fast_cost=1.821e8, fast_s=0.86)
    over = _row(graph="lstm-16", exact_cost=1.538e8 / 1.05, exact_s=24.0,
                exact_rss_bytes=3 * 2**29)
    lost = _row(graph="dense-24", exact_error="timed out after 300 s")
    unasked = _row(graph="cell-250")
    checks = _agreement(graph_checks([within, over, lost, unasked]))
    assert [(c.subject.split()[0], c.passed) for c in checks] == [
        ("dense-16", True), ("lstm-16", False), ("dense-24", None)]
    assert "1.010x" in checks[0].detail and "1.050x" in checks[1].detail
    assert "did not finish: timed out after 300 s" in checks[2].detail
    page = render([within, over, lost, unasked], checks)
    assert "| 1.523e+08 (0 s, 0.2 GiB) | 1.010 | 1.821e+08: plan 0.845x, 0.86 s |" in page
    assert "| 1.465e+08 (24 s, 1.5 GiB) | 1.050 |" in page
    assert "not found: timed out after 300 s | — |" in page
    assert page.count("| — | — |") >= 1  # cell-250: not asked
    assert "**FAIL** within 2% of the exact optimum: lstm-16" in page
    assert EXACT_AGREEMENT == 1.02


def test_a_run_measures_the_plan_and_the_optimum_in_their_own_processes() -> None:
    assert set(EXACT_GRAPHS) <= set(GRAPHS) and "dense-16" in EXACT_GRAPHS
    rows = run(["dense-16"], repeats=1)
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    row = rows[0]
    assert row["exact_cost"] == pytest.approx(exact("dense-16", GRAPHS["dense-16"])["exact_cost"])
    assert row["cost"] <= EXACT_AGREEMENT * row["exact_cost"]
    # the baseline, solved in the same process without the search over every segment
    assert row["exact_cost"] <= row["cost"] < row["fast_cost"] and row["fast_s"] > 0
    (check,) = _agreement(graph_checks(rows))
    assert check.passed is True

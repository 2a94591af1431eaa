"""Which solver plans a budget (fxckpt.solver.portfolio): the per-block solve, the full search
and the hand-written starts fitted to the budget, the cheapest of them; and the smallest peak any
of them reaches, which an infeasible budget states."""

from __future__ import annotations

import pytest

from fxckpt.solver import BudgetInfeasible, Problem, peak_bytes, simulate
from fxckpt.solver.portfolio import min_peak_plan, solve_plan
from fxckpt.solver.selective import Selection, solve_selective
from fxckpt.solver.shared import min_peak_shared, solve_shared
from fxckpt.solver.starts import Start, fit_start
from .test_shared import stack
from .test_starts import cost_of, layers, matmuls, policy


@pytest.mark.parametrize("fraction", [0.45, 0.55, 0.65, 0.75, 0.85])
def test_the_budget_search_is_never_dearer_than_a_start_that_fits(fraction: float) -> None:
    problem, blocks = layers(3)
    eager = simulate(problem, ()).peak_bytes
    budget = int(fraction * eager)
    starts = [policy(problem, blocks), Start(name="per-block", segments=tuple(blocks))]
    chosen = solve_plan(problem, budget, blocks, matmuls(problem), [], starts)
    assert isinstance(chosen, Selection) and chosen.predicted_peak <= budget
    assert chosen.predicted_peak == peak_bytes(problem, chosen.segments, chosen.keep)
    for start in starts:
        fitted = fit_start(problem, start, budget, matmuls(problem))
        if fitted is not None:
            assert chosen.recompute_cost <= fitted.recompute_cost + 1e-6


def test_with_the_policy_as_a_start_the_search_is_at_most_as_dear_as_either() -> None:
    """At the op policy's own peak: never dearer than the policy, nor than the search alone.
    (On this small chain the search alone already beats the policy; on real graphs it does not
    always: tests/planning/test_peers.py.)"""
    problem, blocks = layers(3)
    start = policy(problem, blocks)
    flat = [j for g in start.keep for j in g]
    peak = peak_bytes(problem, start.segments, flat)
    alone = solve_plan(problem, peak, blocks, matmuls(problem), [])
    both = solve_plan(problem, peak, blocks, matmuls(problem), [], [start])
    assert both.recompute_cost <= min(cost_of(problem, start.segments, flat),
                                      alone.recompute_cost)
    assert both.predicted_peak <= peak


def test_the_smallest_peak_counts_the_starts_and_infeasible_budgets_say_it() -> None:
    problem, blocks = layers(3)
    start = Start(name="per-block", segments=tuple(blocks))
    per_block = peak_bytes(problem, start.segments)
    assert min_peak_plan(problem, blocks, [start])[1] <= per_block
    least = min_peak_plan(problem, blocks, [start])[1]
    with pytest.raises(BudgetInfeasible) as e:
        solve_plan(problem, least - 1, blocks, [], [], [start])
    assert e.value.min_budget == least
    assert "smallest budget any plan meets" in str(e.value)


def test_from_ALONE_FROM_ops_the_planner_solves_per_block_only(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The full search takes seconds from a few hundred ops on; with repeated blocks the planner
    then uses the per-block plan alone. Below that it runs both and keeps the cheaper."""
    from fxckpt.solver.shared import ALONE_FROM

    calls: list[int] = []

    def counted(problem: Problem, *args: object) -> object:
        calls.append(len(problem.ops))
        return solve_selective(problem, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("fxckpt.solver.portfolio.solve_selective", counted)
    big, big_blocks = stack(ALONE_FROM // 5 + 1)
    assert len(big.ops) >= ALONE_FROM
    budget = int(0.5 * simulate(big, ()).peak_bytes)
    got = solve_plan(big, budget, big_blocks, [], [])
    assert calls == [] and got.predicted_peak <= budget
    small, small_blocks = stack(16)
    budget = int(0.5 * simulate(small, ()).peak_bytes)
    got = solve_plan(small, budget, small_blocks, [], [])
    shared = solve_shared(small, budget, small_blocks, [], [])
    full = solve_selective(small, budget, [], [])
    assert calls == [len(small.ops)]
    assert got.recompute_cost == min(shared.recompute_cost, full.recompute_cost)


def test_where_no_per_block_plan_fits_the_full_search_is_tried_below_SHARED_FROM() -> None:
    """Near the smallest peak the full search finds plans the per-block solve cannot (here it
    also puts block boundaries and the head in segments): a 312-op stack solved per block alone
    must not call a budget infeasible that the full search meets."""
    from fxckpt.solver import min_feasible_peak
    from fxckpt.solver.shared import ALONE_FROM, SHARED_FROM

    problem, blocks = stack(62)
    assert ALONE_FROM <= len(problem.ops) < SHARED_FROM
    least_shared = min_peak_shared(problem, blocks)
    assert least_shared is not None
    budget = (least_shared[1] + min_feasible_peak(problem)) // 2
    with pytest.raises(BudgetInfeasible):
        solve_shared(problem, budget, blocks, [], [])
    got = solve_plan(problem, budget, blocks, [], [])
    assert got.predicted_peak <= budget and peak_bytes(problem, got.segments) <= budget
    assert min_peak_plan(problem, blocks)[1] == min_feasible_peak(problem)

"""solver/selective.py: inside a plan's segments, keep the outputs that are dear to run again,
as many as the budget's slack holds; and the cheapest such plan over the budget's and tighter
segment plans, never dearer than segments alone."""

from __future__ import annotations

import pytest

from fxckpt.solver import BudgetInfeasible, Op, Problem, peak_bytes
from fxckpt.solver.selective import keep_within, solve_selective
from fxckpt.solver.solve import min_feasible_peak, solve

SEGMENTS = ((0, 4), (5, 7))
"""The smallest-peak plan of the chain (410 bytes, recomputing 123)."""
EACH = [(i,) for i in range(8)]
MATMULS = [(0,), (2,), (4,), (6,)]
"""The ops worth keeping, as the bridge offers them (fewer candidates: a fast search)."""


def _chain() -> Problem:
    """x -> a -> ... -> h -> loss, 100 bytes each: a, c, e, g cost 40 to run again (matmuls),
    b, d, f, h cost 1; each saves its input, gradients of 10 bytes."""
    ops, previous = [], "x"
    for i, name in enumerate("abcdefgh"):
        ops.append(Op(name=name, out_bytes=100, cost=40.0 if i % 2 == 0 else 1.0,
                      inputs=(previous,), saves=(previous,), grad_bytes=10))
        previous = name
    ops.append(Op(name="loss", out_bytes=4, cost=0.0, inputs=(previous,), saves=(previous,),
                  grad_bytes=0))
    return Problem(ops=tuple(ops), outputs=("loss",))


def test_the_chains_smallest_plan() -> None:
    problem = _chain()
    assert (peak_bytes(problem), min_feasible_peak(problem)) == (810, 410)
    assert solve(problem, 410).segments == SEGMENTS


@pytest.mark.parametrize("budget, keep, cost", [
    (410, (3, 6), 82.0),  # no slack: only what frees no peak byte
    (510, (0, 3, 6), 42.0),  # one matmul more
    (610, (0, 2, 3, 6), 2.0),  # both matmuls of the first segment
    (810, (0, 1, 2, 3, 5, 6), 0.0),  # the eager peak: everything
])
def test_more_slack_keeps_more_dearest_per_byte_first(budget: int, keep: tuple,
                                                      cost: float) -> None:
    problem = _chain()
    selection = keep_within(problem, SEGMENTS, budget, EACH)
    assert (selection.segments, selection.keep, selection.recompute_cost) == (SEGMENTS, keep,
                                                                              cost)
    assert selection.predicted_peak == peak_bytes(problem, SEGMENTS, keep) <= budget


def test_pinned_groups_are_kept_whatever_they_cost_and_outside_ones_never() -> None:
    problem = _chain()
    pinned = keep_within(problem, SEGMENTS, 410, EACH, forced=[(1,)])
    assert pinned.keep == (1,) and pinned.predicted_peak == 510 > 410
    outside = keep_within(problem, SEGMENTS, 810, [(4,), (7,)])  # between and after segments
    assert outside.keep == () and outside.recompute_cost == 123.0


def test_the_cheapest_plan_with_kept_ops_is_never_dearer_than_segments_alone() -> None:
    problem = _chain()
    for budget in (410, 510, 710):
        alone = solve(problem, budget)
        selection = solve_selective(problem, budget, MATMULS)
        assert selection.predicted_peak <= budget
        assert selection.recompute_cost < alone.recompute_cost
        plain = solve_selective(problem, budget, [])
        assert (plain.segments, plain.keep) == (alone.segments, ())
        assert plain.recompute_cost == alone.recompute_cost


def test_tighter_segments_leave_room_to_keep_the_matmuls() -> None:
    selection = solve_selective(_chain(), 410, MATMULS)
    assert selection.recompute_cost == 43.0  # 123 with segments alone, 82 keeping within them
    assert selection.segments == ((0, 3), (3, 5), (5, 7)) and selection.keep == (2, 4, 6)
    assert selection.predicted_peak == 410


def test_a_budget_below_the_smallest_peak_is_infeasible() -> None:
    with pytest.raises(BudgetInfeasible):
        solve_selective(_chain(), 300, MATMULS)

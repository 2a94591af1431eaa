"""Selective recompute in the solver: kept ops in the simulator, and the keep/recompute search
checked against an exhaustive oracle over every segmentation and every subset of kept ops."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
from .solver_oracle import _segmentations, random_dag, transformer_like

from fxckpt.solver import Op, Problem, min_feasible_peak, peak_bytes, simulate, solve
from fxckpt.solver import BudgetInfeasible
from fxckpt.solver.selective import keep_within, solve_selective


def _chain() -> Problem:
    """x -> a = mm(x) -> b = gelu(a) -> c = mm(b) -> d = gelu(c); output d."""
    return Problem(ops=(
        Op(name="a", out_bytes=100, cost=50.0, inputs=("x",), saves=("x",)),
        Op(name="b", out_bytes=100, cost=2.0, inputs=("a",), saves=("a",)),
        Op(name="c", out_bytes=100, cost=50.0, inputs=("b",), saves=("b",)),
        Op(name="d", out_bytes=100, cost=2.0, inputs=("c",), saves=("c",)),
    ), outputs=("d",))


def test_a_kept_op_is_held_from_forward_and_not_run_again() -> None:
    p = _chain()
    whole = simulate(p, [(0, 3)])
    kept = simulate(p, [(0, 3)], keep=[0])
    assert kept.recompute_cost == whole.recompute_cost - 50.0 == 52.0
    assert "reuse a" in [e for e, _ in kept.timeline]
    assert "recompute a" not in [e for e, _ in kept.timeline]
    # a's 100 bytes are alive at backward start with the keep, not without it
    at_start = {e: live for e, live in whole.timeline}["backward start"]
    assert {e: live for e, live in kept.timeline}["backward start"] == at_start + 100
    assert peak_bytes(p, [(0, 3)], [0]) == kept.peak_bytes >= whole.peak_bytes


def test_bad_keeps_are_refused() -> None:
    p = _chain()
    with pytest.raises(ValueError, match="not inside a segment"):
        simulate(p, [(0, 2)], keep=[3])
    with pytest.raises(ValueError, match="op position in 0..3"):
        simulate(p, [(0, 2)], keep=[7])
    with pytest.raises(ValueError, match="collection of op positions"):
        simulate(p, [(0, 2)], keep=5)


def _layers() -> Problem:
    """Three ``mm -> gelu`` layers (100 bytes each, a matmul costs 25x a GELU) and a small head."""
    ops, prev = [], "x"
    for k in range(3):
        ops.append(Op(name=f"mm{k}", out_bytes=100, cost=50.0, inputs=(prev,), saves=(prev,)))
        ops.append(Op(name=f"g{k}", out_bytes=100, cost=2.0, inputs=(f"mm{k}",),
                      saves=(f"mm{k}",)))
        prev = f"g{k}"
    ops.append(Op(name="head", out_bytes=10, cost=5.0, inputs=(prev,), saves=(prev,)))
    return Problem(ops=tuple(ops), outputs=("head",))


def test_keep_within_fills_the_slack_most_valuable_first_and_never_passes_the_budget() -> None:
    p = _layers()
    segs = ((0, 2), (2, 4), (4, 6))  # one segment per layer: peak 500 of the eager 710
    matmuls = [(0,), (2,), (4,)]
    assert peak_bytes(p, segs) == 500 and peak_bytes(p) == 710
    assert keep_within(p, segs, 500, matmuls).keep == ()  # no slack: nothing kept
    # keeping the last layer's matmul costs 10 bytes, the first's 100
    last = keep_within(p, segs, 510, matmuls)
    assert last.keep == (4,) and last.predicted_peak == 510 and last.recompute_cost == 106.0
    two = keep_within(p, segs, 610, matmuls)
    assert len(two.keep) == 2 and 4 in two.keep and two.predicted_peak <= 610
    assert keep_within(p, segs, 710, matmuls).keep == (0, 2, 4)


def _oracle(problem: Problem, budget: int, choices: list[tuple[int, ...]]) -> Optional[float]:
    ix = problem.index
    best: Optional[float] = None
    for segs in _segmentations(ix.n):
        inside = {i for s, e in segs for i in range(s, e)}
        cands = [g for g in choices if set(g) <= inside]
        base = sum(ix.segment_cost(s, e) for s, e in segs)
        for r in range(len(cands) + 1):
            for subset in itertools.combinations(cands, r):
                keep = {j for g in subset for j in g}
                cost = base - sum(ix.cost[j] for j in keep)
                if (best is None or cost < best) and peak_bytes(problem, segs, keep) <= budget:
                    best = cost
    return best


@pytest.mark.parametrize("seed", range(12))
def test_within_two_percent_of_the_exhaustive_oracle(seed: int) -> None:
    _agrees(random_dag(7, seed))


@pytest.mark.parametrize("seed", range(12, 60))
def test_within_two_percent_of_the_exhaustive_oracle_on_more_graphs(seed: int) -> None:
    _agrees(random_dag(7 + seed % 2, seed, skip=0.15 * (seed % 4)))


def _agrees(p: Problem) -> None:
    # matmul-like ops (they save their inputs) may be kept, as the bridge offers matmuls
    choices = [(i,) for i, op in enumerate(p.ops) if op.saves == op.inputs and op.cost > 0]
    high = peak_bytes(p)

    low = min_feasible_peak(p)
    for f in (0.2, 0.5, 0.8):
        budget = int(low + f * (high - low))
        got = solve_selective(p, budget, choices)
        best = _oracle(p, budget, choices)
        assert best is not None and got.predicted_peak <= budget
        assert simulate(p, got.segments, got.keep).recompute_cost == got.recompute_cost
        assert got.recompute_cost <= best * 1.02 + 1e-9, (budget, got, best)
        # never worse than whole-segment recompute
        assert got.recompute_cost <= solve(p, budget).recompute_cost


def test_on_a_transformer_it_recomputes_far_less_than_whole_segments_at_the_same_budget() -> None:
    p = transformer_like(6, extra_views=0)
    names = ("qkv", "scores", "ctx", "proj", "fc", "fc2")
    choices = [(i,) for i, op in enumerate(p.ops) if op.name.rsplit(".", 1)[-1] in names]
    budget = peak_bytes(p) // 2
    whole, selective = solve(p, budget), solve_selective(p, budget, choices)
    assert selective.predicted_peak <= budget
    assert selective.recompute_cost < 0.6 * whole.recompute_cost
    kept = {p.ops[j].name.rsplit(".", 1)[-1] for j in selective.keep}
    assert kept <= set(names) and "fc" in kept or "qkv" in kept


def test_infeasible_budgets_say_the_same_minimum_as_the_segment_solver() -> None:
    p = _chain()
    with pytest.raises(BudgetInfeasible) as seg:
        solve(p, 1)
    with pytest.raises(BudgetInfeasible) as sel:
        solve_selective(p, 1, [(0,), (2,)])
    assert sel.value.min_budget == seg.value.min_budget > 1

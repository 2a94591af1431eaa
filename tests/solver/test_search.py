"""solver.search: the dynamic programme against brute force over every segmentation.

In an exact space the search must find, for every budget, exactly the oracle's least cost (or
nothing when no plan fits), and its own peak accounting must equal the simulator's for the plan
it returns. Also: the lowest-peak mode, cost caps, fast spaces, and the edge cases (no op, one
op, zero-size tensors, budgets below the minimum).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math

import pytest
from .solver_oracle import random_chain, random_dag, transformer_like

from fxckpt.solver import Op, Problem, Spans, peak_bytes
from fxckpt.solver.moves import Space
from fxckpt.solver.bounds import pareto_front as _pareto
from fxckpt.solver.search import _lower_hull, search

EXACT, FAST = Space(exact=True), Space(exact=False)


def _segmentations(n: int) -> list[Spans]:
    """Every plan: each op is outside, starts a segment, or continues the open one."""
    plans: list[Spans] = []

    def rec(i: int, start: int, acc: tuple) -> None:
        if i == n:
            plans.append(acc + (((start, n),) if start >= 0 else ()))
            return
        closed = acc + (((start, i),) if start >= 0 else ())
        rec(i + 1, -1, closed)
        rec(i + 1, i, closed)
        if start >= 0:
            rec(i + 1, start, acc)

    rec(0, -1, ())
    return plans


@functools.cache
def scored(problem: Problem) -> list[tuple[int, float, Spans]]:
    """(peak, cost, plan) of every plan; cost with the problem's overhead and offload prices."""
    ix = problem.index
    return [(peak_bytes(problem, segs), sum(ix.segment_cost(s, e) for s, e in segs), segs)
            for segs in _segmentations(ix.n)]


def _with(problem: Problem, **changes: object) -> Problem:
    return dataclasses.replace(problem, **changes)


PROBLEMS = {
    **{f"dag{n}-{seed}": random_dag(n, seed) for n, seed in ((4, 0), (6, 1), (7, 2), (8, 3))},
    **{f"chain{n}-{seed}": random_chain(n, seed) for n, seed in ((5, 4), (8, 5))},
    "overhead": _with(random_dag(7, 6), segment_overhead=5.0),
    "offload": _with(random_dag(7, 7), offload_cost_per_byte=0.01),
    "transformer": transformer_like(0, extra_views=0),
}


def budgets(plans: list[tuple[int, float, Spans]]) -> list[int]:
    peaks = sorted({p for p, _, _ in plans})
    return [peaks[0] - 1] + peaks + [(a + b) // 2 for a, b in zip(peaks, peaks[1:])]


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_exact_search_finds_the_cheapest_plan_for_every_budget(name: str) -> None:
    problem = PROBLEMS[name]
    plans = scored(problem)
    ix = problem.index
    for budget in budgets(plans):
        fitting = [c for p, c, _ in plans if p <= budget]
        found = search(ix, EXACT, budget)
        if not fitting:
            assert found is None, (budget, found)
            continue
        assert found is not None, budget
        assert found.cost == pytest.approx(min(fitting), abs=1e-9), (budget, found)
        assert found.peak == peak_bytes(problem, found.segments) <= budget
        assert found.cost == pytest.approx(sum(ix.segment_cost(s, e) for s, e in found.segments))


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_lowest_peak_mode_finds_the_lowest_peak(name: str) -> None:
    problem = PROBLEMS[name]
    lowest = min(p for p, _, _ in scored(problem))
    found = search(problem.index, EXACT, math.inf, by_peak=True)
    assert found is not None and found.peak == lowest
    assert peak_bytes(problem, found.segments) == lowest
    assert search(problem.index, EXACT, lowest - 1, by_peak=True) is None
    again = search(problem.index, EXACT, lowest, by_peak=True)
    assert again is not None and again.peak == lowest


def test_cost_cap_excludes_dearer_plans() -> None:
    problem = PROBLEMS["dag8-3"]
    plans = scored(problem)
    lowest = min(p for p, _, _ in plans)
    cheapest = min(c for p, c, _ in plans if p <= lowest)
    assert cheapest > 0
    ix = problem.index
    assert search(ix, EXACT, lowest, cost_cap=cheapest * 0.99) is None
    found = search(ix, EXACT, lowest, cost_cap=cheapest)
    assert found is not None and found.cost == pytest.approx(cheapest)


@pytest.mark.parametrize("problem", [random_dag(20, 8), transformer_like(2, extra_views=2)],
                         ids=["dag20", "transformer"])
def test_fast_space_meets_its_own_lowest_peak_and_agrees_with_the_simulator(
        problem: Problem) -> None:
    ix = problem.index
    low = search(ix, FAST, math.inf, by_peak=True)
    assert low is not None and low.peak == peak_bytes(problem, low.segments)
    high = peak_bytes(problem)
    for budget in (low.peak, (low.peak + high) // 2, high):
        found = search(ix, FAST, budget)
        assert found is not None, budget  # a plan of the space fits: the search finds one
        assert found.peak == peak_bytes(problem, found.segments) <= budget
    assert search(ix, FAST, high).cost == 0.0  # type: ignore[union-attr]


def test_no_ops() -> None:
    ix = Problem(ops=(), outputs=()).index
    found = search(ix, EXACT, 0)
    assert found is not None and (found.segments, found.peak, found.cost) == ((), 0, 0.0)
    assert search(ix, EXACT, -1) is None


def test_one_op_by_hand() -> None:
    """a = mm(x) 100 B, the output: forward 100; backward start a + grad a = 200; a recompute
    (a' + grad a) is no higher. So no plan goes below 200, and the free plan is the answer."""
    problem = Problem(ops=(Op(name="a", out_bytes=100, cost=3.0, inputs=("x",), saves=("x",)),),
                      outputs=("a",))
    assert peak_bytes(problem) == peak_bytes(problem, [(0, 1)]) == 200
    found = search(problem.index, EXACT, 200)
    assert found is not None and (found.segments, found.peak, found.cost) == ((), 200, 0.0)
    assert search(problem.index, EXACT, 199) is None
    assert search(problem.index, FAST, 199) is None


def test_chain_of_three_matmuls_by_hand() -> None:
    """a = mm(x), b = mm(a), c = mm(b): 100 B each, each saving its input; d = sum(c) 10 B is
    the output; no gradients (to keep the arithmetic short).

    no plan:  forward d holds a, b, c, d                                    = 310
    [1, 3):   forward c holds a (its input), b, c; the recompute a, b', c'  = 300
    [0, 2):   a is let go after b; at d: b (saved by c), c, d               = 210
    Nothing goes lower (the oracle agrees): 209 is infeasible.
    """
    problem = Problem(ops=(
        Op(name="a", out_bytes=100, cost=2.0, inputs=("x",), saves=("x",), grad_bytes=0),
        Op(name="b", out_bytes=100, cost=1.0, inputs=("a",), saves=("a",), grad_bytes=0),
        Op(name="c", out_bytes=100, cost=1.0, inputs=("b",), saves=("b",), grad_bytes=0),
        Op(name="d", out_bytes=10, cost=1.0, inputs=("c",), grad_bytes=0),
    ), outputs=("d",))
    assert peak_bytes(problem) == 310
    assert peak_bytes(problem, [(1, 3)]) == 300 and peak_bytes(problem, [(0, 2)]) == 210
    ix = problem.index
    expected = {310: ((), 0.0), 309: (((1, 3),), 2.0), 300: (((1, 3),), 2.0),
                299: (((0, 2),), 3.0), 210: (((0, 2),), 3.0)}
    for budget, (segments, cost) in expected.items():
        found = search(ix, EXACT, budget)
        assert found is not None and (found.segments, found.cost) == (segments, cost), budget
    assert search(ix, EXACT, 209) is None


def test_zero_size_tensors_need_no_plan() -> None:
    ops = tuple(Op(name=f"v{i}", out_bytes=0, cost=1.0, inputs=(f"v{i - 1}",) if i else ("x",),
                   saves=(f"v{i - 1}",) if i else ()) for i in range(5))
    problem = Problem(ops=ops, outputs=("v4",))
    for space in (EXACT, FAST):
        found = search(problem.index, space, 0)
        assert found is not None and (found.segments, found.peak, found.cost) == ((), 0, 0.0)
        assert search(problem.index, space, -1) is None


def test_garbage_collection_state_is_restored() -> None:
    problem = random_dag(6, 9)
    assert gc.isenabled()
    search(problem.index, EXACT, math.inf)
    assert gc.isenabled()
    gc.disable()
    try:
        search(problem.index, EXACT, math.inf)
        assert not gc.isenabled()
    finally:
        gc.enable()


def _entry(h: int, obj: float, tie: int = 0) -> tuple:
    return (h, obj, tie, None, (0, 0, False))


def test_pareto_front_keeps_entries_with_falling_objective() -> None:
    entries = [_entry(5, 3.0), _entry(1, 9.0), _entry(3, 9.0), _entry(2, 4.0), _entry(4, 4.0),
               _entry(1, 9.0, tie=-1)]
    front = _pareto(entries)
    assert [(e[0], e[1], e[2]) for e in front] == [(1, 9.0, -1), (2, 4.0, 0), (5, 3.0, 0)]


def test_lower_hull_drops_points_above_the_chords() -> None:
    front = [_entry(0, 10.0), _entry(1, 9.0), _entry(2, 4.0), _entry(3, 3.0), _entry(6, 0.0)]
    # (1, 9) lies above the chord (0,10)-(2,4); (3, 3) lies on or above (2,4)-(6,0).
    assert [(e[0], e[1]) for e in _lower_hull(front)] == [(0, 10.0), (2, 4.0), (6, 0.0)]

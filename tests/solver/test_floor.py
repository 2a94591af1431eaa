"""The recompute floor: a lower bound no plan beats, checked against every plan of small graphs
(every segmentation and every set of kept ops, scored by the public simulator), under every
pricing the problem offers (segment overhead, hooks, keep price, early stop, offload)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import pytest
from .solver_oracle import _segmentations, random_dag, transformer_like
from .test_keep_search import _chain  # mm -> gelu -> mm -> gelu, 100 bytes each

from fxckpt.solver import Problem, min_feasible_peak, peak_bytes, simulate, solve
from fxckpt.solver.floor import gap, recompute_floor
from fxckpt.solver.selective import solve_selective


def test_the_floor_of_a_chain_is_the_cheapest_bytes_dropped_first() -> None:
    p = _chain()
    eager = peak_bytes(p)
    # backward start holds a, b, c (saved) and d (the output) and d's gradient: 500 bytes
    assert eager == 500 and recompute_floor(p, eager) == 0.0
    # 100 bytes to drop: b (2 per 100 bytes) is the cheapest value that may go
    assert recompute_floor(p, 400) == 2.0
    # 150: all of b and half of a or c (50 per 100 bytes): 2 + 25
    assert recompute_floor(p, 350) == 27.0
    # d is an output: a, b and c together free at most 300 bytes
    assert recompute_floor(p, 199) == math.inf
    # the overhead is paid once by any plan that drops something
    assert recompute_floor(dataclasses.replace(p, segment_overhead=5.0), 400) == 7.0


def test_the_floor_counts_hooks_and_the_offload_price_per_dropped_op() -> None:
    hooks = Problem(ops=tuple(dataclasses.replace(op, saved_tensors=2) for op in _chain().ops),
                    outputs=("d",), saved_overhead=1.5)
    # b's 2 and its hooks, and c's hooks: c saves b, so it is in b's segment (kept, at best)
    assert recompute_floor(hooks, 400) == 2.0 + 3.0 + 3.0
    # offloading a's 100 bytes costs 10, less than recomputing it (50): half of it plus all of b
    offload = dataclasses.replace(_chain(), offload_cost_per_byte=0.1)
    assert recompute_floor(offload, 350) == 2.0 + 5.0


def _best(problem: Problem, budget: int) -> Optional[float]:
    """The least recompute cost of every plan (segments, and any subset of the ops inside them
    kept) whose simulated peak fits ``budget``."""
    best: Optional[float] = None
    for segs in _segmentations(problem.index.n):
        inside = [i for s, e in segs for i in range(s, e) if problem.ops[i].cost > 0]
        for r in range(len(inside) + 1):
            for keep in itertools.combinations(inside, r):
                sim = simulate(problem, segs, keep)
                if sim.peak_bytes <= budget and (best is None or sim.recompute_cost < best):
                    best = sim.recompute_cost
    return best


PRICINGS = {
    "plain": {},
    "overheads": {"segment_overhead": 7.0, "saved_overhead": 0.5, "keep_overhead": 3.0},
    "early stop": {"early_stop": True},
    "offload": {"offload_cost_per_byte": 0.02},
    "all": {"segment_overhead": 7.0, "saved_overhead": 0.5, "keep_overhead": 3.0,
            "early_stop": True, "offload_cost_per_byte": 0.05},
}


def _check(seed: int, pricing: str) -> None:
    base = random_dag(6, seed)
    ops = tuple(dataclasses.replace(op, saved_tensors=len(op.saves)) for op in base.ops)
    p = dataclasses.replace(base, ops=ops, **PRICINGS[pricing])  # type: ignore[arg-type]
    low, high = min_feasible_peak(p, mode="exact"), peak_bytes(p)
    budgets = sorted({int(low + f * (high - low)) for f in (0.0, 0.25, 0.5, 0.75, 1.0)})
    tight = 0
    for budget in budgets:
        best = _best(p, budget)
        floor = recompute_floor(p, budget)
        assert best is not None and floor <= best + 1e-9, (budget, floor, best)
        tight += floor > 0
    assert tight or high == low  # the floor says something below the unmodified peak


@pytest.mark.parametrize("pricing", sorted(PRICINGS))
@pytest.mark.parametrize("seed", range(2))
def test_no_plan_of_a_small_graph_recomputes_less_than_the_floor(seed: int, pricing: str) -> None:
    _check(seed, pricing)


@pytest.mark.parametrize("pricing", sorted(PRICINGS))
@pytest.mark.parametrize("seed", range(2, 10))
def test_no_plan_of_more_small_graphs_recomputes_less_than_the_floor(seed: int,
                                                                       pricing: str) -> None:
    _check(seed, pricing)


def test_the_floor_holds_under_the_plans_the_solvers_make_for_a_transformer() -> None:
    p = transformer_like(2, extra_views=0, seq=16)
    names = ("qkv", "scores", "ctx", "proj", "fc", "fc2")
    choices = [(i,) for i, op in enumerate(p.ops) if op.name.rsplit(".", 1)[-1] in names]
    high, low = peak_bytes(p), min_feasible_peak(p)
    for f in (0.5, 0.8):
        budget = int(low + f * (high - low))
        for plan in (solve(p, budget), solve_selective(p, budget, choices)):
            floor = recompute_floor(p, plan.predicted_peak)
            assert 0 < floor <= plan.recompute_cost
            assert gap(plan.recompute_cost, floor) == pytest.approx(
                1 - floor / plan.recompute_cost)


def test_gap_is_a_share_of_the_plan_and_never_negative() -> None:
    assert gap(100.0, 80.0) == pytest.approx(0.2)
    assert gap(100.0, 120.0) == 0.0 and gap(0.0, 0.0) == 0.0

"""The budget solver against an exhaustive oracle, and its promises on bigger graphs.

The oracle (``solver_oracle.py``) scores every segmentation with the simulator. The solver must
never exceed a budget, must agree with the oracle on which budgets are feasible, and must cost at
most 5% more than the oracle's optimum (exact mode: not more at all).
"""

from __future__ import annotations

import functools
import math
import time

import pytest
from .solver_oracle import Scored, all_plans, exhaustive, random_chain, random_dag, \
    transformer_like

from fxckpt.solver import BudgetInfeasible, Problem, min_feasible_peak, pareto, peak_bytes, \
    simulate, solve

SMALL = [(kind, n, seed) for kind in ("dag", "chain") for n in (3, 5, 7, 9, 10)
         for seed in range(4)]


@functools.lru_cache(maxsize=None)
def instance(kind: str, n: int, seed: int) -> tuple[Problem, list[Scored]]:
    problem = (random_dag if kind == "dag" else random_chain)(n, seed)
    return problem, all_plans(problem)


def budgets(plans: list[Scored]) -> list[int]:
    """Every peak on the oracle's cost/peak Pareto frontier, plus points between them."""
    frontier, best = [], math.inf
    for p in sorted(plans, key=lambda p: (p.peak, p.cost)):
        if p.cost < best:
            frontier.append(p.peak)
            best = p.cost
    between = [(a + b) // 2 for a, b in zip(frontier, frontier[1:])]
    return sorted(set(frontier + between))


def check_against_oracle(problem: Problem, plans: list[Scored], mode: str, tol: float) -> None:
    lowest = min(p.peak for p in plans)
    for budget in budgets(plans) + ([lowest - 1] if lowest else []):
        best = exhaustive(problem, budget, plans)
        if best is None:
            with pytest.raises(BudgetInfeasible) as info:
                solve(problem, budget, mode=mode)
            if mode == "auto":
                assert info.value.min_budget == lowest
            else:  # fast mode: a budget some plan it can find meets
                assert info.value.min_budget >= lowest
                solve(problem, info.value.min_budget, mode=mode)
            continue
        sol = solve(problem, budget, mode=mode)
        assert sol.predicted_peak <= budget
        assert sol.predicted_peak == simulate(problem, sol.segments).peak_bytes
        assert sol.recompute_cost <= best.cost * (1 + tol) + 1e-9, (budget, sol, best)
        assert sol.recompute_cost >= best.cost - 1e-9  # nothing beats the oracle


@pytest.mark.parametrize("kind, n, seed", SMALL)
def test_exact_mode_matches_the_oracle(kind: str, n: int, seed: int) -> None:
    problem, plans = instance(kind, n, seed)
    check_against_oracle(problem, plans, "auto", tol=0.0)
    assert min_feasible_peak(problem) == min(p.peak for p in plans)


@pytest.mark.parametrize("kind, n, seed", SMALL[::2])
def test_fast_mode_is_within_five_percent(kind: str, n: int, seed: int) -> None:
    problem, plans = instance(kind, n, seed)
    check_against_oracle(problem, plans, "fast", tol=0.05)


@pytest.mark.parametrize("kind, n, seed", [("dag", 12, 101), ("chain", 12, 102)])
def test_twelve_ops(kind: str, n: int, seed: int) -> None:
    problem, plans = instance(kind, n, seed)
    check_against_oracle(problem, plans, "auto", tol=0.0)
    check_against_oracle(problem, plans, "fast", tol=0.05)


@pytest.mark.slow
def test_fourteen_ops_dag() -> None:
    problem, plans = instance("dag", 14, 7)  # 514229 plans, ~15 s of simulation
    check_against_oracle(problem, plans, "auto", tol=0.0)
    check_against_oracle(problem, plans, "fast", tol=0.05)


def test_infeasible_error_names_the_minimum() -> None:
    problem, plans = instance("dag", 7, 1)
    lowest = min(p.peak for p in plans)
    with pytest.raises(BudgetInfeasible, match=f"smallest budget any plan meets is {lowest} "):
        solve(problem, lowest - 1)
    assert isinstance(BudgetInfeasible(1, 2), ValueError)


@pytest.mark.parametrize("budget", [-1, float("nan"), float("inf"), True, "1GB", None])
def test_bad_budget(budget: object) -> None:
    with pytest.raises(ValueError, match="budget_bytes must be a finite number >= 0"):
        solve(random_chain(4, 0), budget)  # type: ignore[arg-type]


def test_bad_mode_and_points() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        solve(random_chain(4, 0), 10**9, mode="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="points must be a positive int"):
        pareto(random_chain(4, 0), points=0)


def test_budget_at_no_checkpoint_peak_costs_nothing() -> None:
    problem = transformer_like(2, extra_views=1)
    sol = solve(problem, peak_bytes(problem))
    assert sol.recompute_cost == 0 and sol.segments == ()


@pytest.mark.parametrize("problem", [random_dag(9, 3), random_chain(10, 4),
                                     transformer_like(3, extra_views=2)],
                         ids=["dag", "chain", "transformer"])
def test_pareto_is_monotone(problem: Problem) -> None:
    curve = pareto(problem, points=7)
    assert [p.budget for p in curve] == sorted(p.budget for p in curve)
    assert curve[0].budget == min_feasible_peak(problem)
    for lo, hi in zip(curve, curve[1:]):
        assert lo.predicted_peak <= hi.predicted_peak  # a smaller budget never peaks higher
        assert lo.recompute_cost >= hi.recompute_cost  # ... nor costs less
    assert all(p.predicted_peak <= p.budget for p in curve)
    assert curve[-1].recompute_cost == 0


def test_fast_mode_near_exact_on_medium_graphs() -> None:
    """30-op problems: exact mode is still cheap, so it can judge the fast search."""
    for problem in (random_dag(30, 5), transformer_like(2, extra_views=0)):
        low, high = min_feasible_peak(problem, mode="exact"), peak_bytes(problem)
        assert min_feasible_peak(problem, mode="fast") <= low * 1.05
        for frac in (0.1, 0.3, 0.6, 0.9):
            budget = int(low + (high - low) * frac)
            exact = solve(problem, budget, mode="exact")
            fast = solve(problem, budget, mode="fast")
            assert fast.predicted_peak <= budget
            assert fast.recompute_cost <= exact.recompute_cost * 1.05 + 1e-9


def test_gpt2_sized_graph_solves_quickly() -> None:
    problem = transformer_like(12)  # 1562 ops: embedding, 12 blocks of 130 ops, loss
    assert len(problem.ops) == 1562
    high = peak_bytes(problem)
    low = min_feasible_peak(problem)
    assert low < high / 4
    budget = (low + high) // 2
    start = time.perf_counter()
    sol = solve(problem, budget)
    seconds = time.perf_counter() - start
    assert seconds < 3.0, f"solve took {seconds:.2f} s for {len(problem.ops)} ops"
    assert sol.predicted_peak <= budget
    assert simulate(problem, sol.segments).peak_bytes == sol.predicted_peak
    assert 0 < sol.recompute_cost < problem.index.cum_cost[-1] / 2


def test_modes_say_whether_the_answer_is_optimal() -> None:
    problem = random_dag(9, 11)
    budget = (min_feasible_peak(problem) + peak_bytes(problem)) // 2
    assert solve(problem, budget).optimal  # 9 ops: auto searches exactly
    assert solve(problem, budget, mode="exact").optimal
    assert not solve(problem, budget, mode="fast").optimal


def test_offload_is_a_third_state_priced_per_byte() -> None:
    """With cheap copies the least-cost plan offloads; with dear ones it recomputes as before."""
    from fxckpt.solver import Op, Problem, simulate, solve

    ops = [Op(name="a", out_bytes=100, cost=1000.0, inputs=("x",), saves=("x",))]
    for prev, name in zip("abcd", "bcde"):
        ops.append(Op(name=name, out_bytes=100, cost=1000.0, inputs=(prev,), saves=(prev,)))
    plain = Problem(ops=tuple(ops), outputs=("e",))
    budget = simulate(plain, ()).peak_bytes - 150
    recompute = solve(plain, budget)
    cheap = solve(Problem(ops=tuple(ops), outputs=("e",), offload_cost_per_byte=0.01), budget)
    dear = solve(Problem(ops=tuple(ops), outputs=("e",), offload_cost_per_byte=1e6), budget)
    assert recompute.recompute_cost >= 1000.0
    assert cheap.recompute_cost < 10.0 and cheap.predicted_peak <= budget
    assert dear.recompute_cost == recompute.recompute_cost
    cheap_ix = Problem(ops=tuple(ops), outputs=("e",), offload_cost_per_byte=0.01).index
    assert all(cheap_ix.segment_offloads(a, b) for a, b in cheap.segments)

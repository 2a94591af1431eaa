"""Hand-written plans as starts of the budget search (fxckpt.solver.starts): a start is fitted to
the budget (kept groups given up least dense first, the memory left spent on more kept groups or
on fewer segments). The search against the starts it is given: tests/solver/test_portfolio.py."""

from __future__ import annotations

import dataclasses


from fxckpt.solver import Problem, peak_bytes, simulate
from fxckpt.solver.starts import Start, fit_start
from .test_shared import stack


def layers(count: int) -> tuple[Problem, list[tuple[int, int]]]:
    """:func:`test_shared.stack`'s chain with dearer matmuls and a cheap activation (too few
    blocks for the per-block solver), keeping an op costing a little."""
    problem, blocks = stack(count)
    price = {"up": 8e8, "down": 8e8, "act": 2e6}
    ops = tuple(dataclasses.replace(op, cost=price.get(op.name.rstrip("0123456789"), op.cost))
                for op in problem.ops)
    return dataclasses.replace(problem, ops=ops, keep_overhead=1e5), blocks


def matmuls(problem: Problem) -> list[tuple[int, ...]]:
    return [(j,) for j, op in enumerate(problem.ops) if op.name.startswith(("up", "down"))]


def policy(problem: Problem, blocks: list[tuple[int, int]]) -> Start:
    """The op policy: every block a segment, every matmul kept."""
    return Start(name="op policy", segments=tuple(blocks), keep=tuple(matmuls(problem)))


def cost_of(problem: Problem, segments, keep) -> float:
    ix = problem.index
    return sum(ix.segment_cost(s, e) for s, e in segments) - ix.kept_gain(segments, keep)


def test_a_start_that_fits_is_kept_whole_and_never_made_dearer() -> None:
    problem, blocks = layers(3)
    start = policy(problem, blocks)
    flat = [j for g in start.keep for j in g]
    peak = peak_bytes(problem, start.segments, flat)
    fitted = fit_start(problem, start, peak, matmuls(problem))
    assert fitted is not None and fitted.origin == "op policy"
    assert fitted.predicted_peak <= peak
    assert set(flat) <= set(fitted.keep)
    assert fitted.recompute_cost <= cost_of(problem, start.segments, flat)


def test_a_start_over_the_budget_gives_up_its_least_dense_groups_first() -> None:
    problem, blocks = layers(3)
    ix = problem.index
    start = policy(problem, blocks)
    flat = [j for g in start.keep for j in g]
    full = peak_bytes(problem, start.segments, flat)
    bare = peak_bytes(problem, start.segments)
    budget = (full + bare) // 2
    fitted = fit_start(problem, start, budget, matmuls(problem))
    assert fitted is not None and fitted.predicted_peak <= budget
    kept = set(fitted.keep)
    assert kept and kept < set(flat)
    # every kept matmul saves at least as much per byte as every one given up
    density = {j: ix.gain[j] / ix.out[j] for j in flat}
    assert min(density[j] for j in kept) >= max(density[j] for j in set(flat) - kept)
    assert fitted.predicted_peak == peak_bytes(problem, fitted.segments, fitted.keep)


def test_a_start_whose_segments_do_not_fit_is_left_out() -> None:
    problem, blocks = layers(3)
    start = policy(problem, blocks)
    assert fit_start(problem, start, peak_bytes(problem, start.segments) - 1,
                     matmuls(problem)) is None


def test_memory_left_over_leaves_the_last_segments_out() -> None:
    problem, blocks = layers(4)
    start = Start(name="per-block", segments=tuple(blocks))
    eager = simulate(problem, ()).peak_bytes
    fitted = fit_start(problem, start, int(0.9 * eager), [])
    assert fitted is not None
    assert fitted.segments == tuple(blocks[:len(fitted.segments)])
    assert 0 < len(fitted.segments) < len(blocks)
    assert fitted.predicted_peak <= int(0.9 * eager)


def test_groups_the_solver_is_not_offered_are_never_kept() -> None:
    problem, blocks = layers(3)
    start = policy(problem, blocks)
    ups = [g for g in matmuls(problem) if problem.ops[g[0]].name.startswith("up")]
    fitted = fit_start(problem, start, simulate(problem, ()).peak_bytes, ups)
    assert fitted is not None
    assert all(problem.ops[j].name.startswith("up") for j in fitted.keep)

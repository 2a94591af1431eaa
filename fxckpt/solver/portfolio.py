"""Which solver plans a budget: the per-block solve, the full search, the hand-written plans
fitted to the budget (:mod:`fxckpt.solver.starts`): the cheapest of them.

Pure policy over plain data, like the rest of the solver: :func:`solve_plan` is what
``budget=`` runs (through :func:`fxckpt.planning.strategies.budgeted`), :func:`min_peak_plan`
the smallest peak it can offer when a budget cannot be met. The sizes that switch between
solvers are :data:`~fxckpt.solver.shared.ALONE_FROM` and
:data:`~fxckpt.solver.shared.SHARED_FROM` (``docs/tuning.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from fxckpt.errors import BudgetInfeasible
from fxckpt.solver.problem import Problem, Spans
from fxckpt.solver.selective import Choices, Selection, solve_selective
from fxckpt.solver.shared import ALONE_FROM, SHARED_FROM, families, min_peak_shared, solve_shared
from fxckpt.solver.simulate import peak_bytes
from fxckpt.solver.solve import min_feasible_peak, min_peak_segments
from fxckpt.solver.starts import Start, fit_starts

__all__ = ["solve_plan", "min_peak_plan", "solved_per_block"]


def solved_per_block(problem: Problem, blocks: Sequence[tuple[int, int]],
                     size: int = ALONE_FROM) -> bool:
    """A graph of repeated blocks with at least ``size`` ops: solved per block only
    (:mod:`fxckpt.solver.shared`)."""
    return problem.index.n >= size and bool(families(problem, blocks))


def min_peak_plan(problem: Problem, blocks: Sequence[tuple[int, int]],
                  starts: Sequence[Start] = ()) -> tuple[Spans, int]:
    """The smallest-peak plan found, and its peak: per block for graphs of repeated blocks from
    :data:`~fxckpt.solver.shared.SHARED_FROM` ops, otherwise the better of that and the full
    search's (one search by peak: the full search's smallest plan is often smaller, as when it
    checkpoints the embeddings too); a start's segments (no kept op) where they are smaller."""
    plans = [(s.segments, peak_bytes(problem, s.segments)) for s in starts]
    shared = min_peak_shared(problem, blocks)
    if shared is not None and solved_per_block(problem, blocks, SHARED_FROM):
        return min([shared, *plans], key=lambda p: p[1])
    full = min_peak_segments(problem)
    plans += [(full, min_feasible_peak(problem))] + ([shared] if shared else [])
    return min(plans, key=lambda p: p[1])


def solve_plan(problem: Problem, target: int, blocks: Sequence[tuple[int, int]],
               offered: Choices, forced: Choices, starts: Sequence[Start] = ()) -> Selection:
    """The cheapest of :func:`search_plan` and every start fitted to ``target``
    (:func:`~fxckpt.solver.starts.fit_starts`): never dearer than a start that fits, by the
    solver's prices. Raises :class:`BudgetInfeasible` when neither finds a plan."""
    idle = peak_bytes(problem)
    if idle <= target:
        return Selection(segments=(), keep=(), predicted_peak=idle, recompute_cost=0.0)
    fitted = fit_starts(problem, starts, target, offered, forced)
    try:
        searched = search_plan(problem, target, blocks, offered, forced)
    except BudgetInfeasible as e:
        if not fitted:
            least = min((peak_bytes(problem, s.segments) for s in starts), default=e.min_budget)
            raise BudgetInfeasible(target, min(least, e.min_budget)) from None
        searched = None
    found = [*fitted, *([searched] if searched is not None else [])]
    best = min(found, key=lambda sel: (sel.recompute_cost, sel.predicted_peak))
    if searched is not None and best is not searched and searched.bound is not None:
        best = dataclasses.replace(best, bound=searched.bound)
    return best


def search_plan(problem: Problem, target: int, blocks: Sequence[tuple[int, int]],
                offered: Choices, forced: Choices) -> Selection:
    """The cheapest plan found under ``target``: solved per repeated block
    (:func:`~fxckpt.solver.shared.solve_shared`) from :data:`~fxckpt.solver.shared.ALONE_FROM`
    ops; for smaller graphs, the cheaper of that and the full search
    (:func:`~fxckpt.solver.selective.solve_selective`), which may mix plans across blocks but is
    not exact either (the per-block plan often wins). Where no per-block plan fits, the full
    search is tried below :data:`~fxckpt.solver.shared.SHARED_FROM` ops: near the smallest peak
    it finds plans the per-block solve does not (segments over the embeddings, say).
    """
    idle = peak_bytes(problem)
    if idle <= target:  # the unmodified step fits: nothing to recompute, nothing to search
        return Selection(segments=(), keep=(), predicted_peak=idle, recompute_cost=0.0)
    shared: Optional[Selection] = None
    infeasible: Optional[BudgetInfeasible] = None
    try:
        shared = solve_shared(problem, target, blocks, offered, forced)
    except BudgetInfeasible as e:
        infeasible = e
    if shared is not None and solved_per_block(problem, blocks):
        return shared
    if infeasible is not None and solved_per_block(problem, blocks, SHARED_FROM):
        raise infeasible
    try:
        full = solve_selective(problem, target, offered, forced)
    except BudgetInfeasible as e:
        if shared is None:
            raise infeasible if infeasible and infeasible.min_budget < e.min_budget else e
        return shared
    if shared is not None and (shared.recompute_cost, shared.predicted_peak) < (
            full.recompute_cost, full.predicted_peak):
        return dataclasses.replace(shared, bound=full.bound)
    return full

"""The memory-budget solver: least recompute whose simulated peak fits the budget.

``solve`` runs the dynamic programme of :mod:`fxckpt.solver.search`, whose peak accounting is an
exact decomposition of :func:`fxckpt.solver.simulate.simulate`, then checks the plan it found with
the simulator itself. The check is the promise: a returned plan's ``predicted_peak`` is what
``simulate`` says, and it is never above the budget. (Should the two ever disagree — a bug — the
solver logs it and re-plans with a budget lowered by the overshoot.)

Small problems (``mode="exact"``, the default up to :data:`EXACT_LIMIT` ops) are searched over
every segmentation with unbounded Pareto fronts: the answer is optimal for the cost model (the
DP state grows with the number of values crossing a cut, so this is kept for small graphs).

Larger ones (``mode="fast"``) are searched over a restricted set of blocks (see
:mod:`fxckpt.solver.moves`) with fronts bounded to about 32 entries: the lower convex hull (the
plans a Lagrangian price on held memory would pick) plus entries spread 5% apart in cost. That
keeps the work linear in the number of ops. Up to :data:`REFINE_LIMIT` ops a second pass keeps
fronts four times finer but only below the first pass's cost, which it then rarely misses by
more than a percent.

Every plan the solver returns has been re-simulated, so ``predicted_peak <= budget`` holds in
every mode; only the optimality of the cost is approximate in fast mode.

Work is bounded on every graph (:mod:`fxckpt.solver.bounds`): where the search gives up on
being exact (many values live across cuts), a bounded heuristic answers, and the solution
carries a :class:`Bound`: a lower bound on the recompute of every plan the search considers,
from a relaxed search, so the plan's distance from the best is known. A fast-mode graph of up to
:data:`WIDE_LIMIT` ops where the search gave up is searched over every segment too, and its
bound then holds for every segmentation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal, NamedTuple, Optional

from fxckpt.errors import BudgetInfeasible
from fxckpt.solver.floor import gap
from fxckpt.solver.moves import Space
from fxckpt.solver.problem import Key, Problem, Spans
from fxckpt.solver.search import Found, gave_up, lower_bound, search
from fxckpt.solver.simulate import peak_bytes

__all__ = [
    "Solution", "Bound", "ParetoPoint", "solve", "min_feasible_peak", "min_peak_segments",
    "pareto", "bound_for", "heuristic", "EXACT_LIMIT", "REFINE_LIMIT",
]

log = logging.getLogger(__name__)

EXACT_LIMIT = 32
"""Problems with at most this many ops are solved exactly in ``mode="auto"``."""

REFINE_LIMIT = 500
"""Fast-mode problems with at most this many ops get a second, finer pass capped at the first
pass's cost (it costs about as much as the first pass and grows faster than linearly). On a
12-layer GPT-2 (608 ops) the second pass took 1.1 s to save 1-6% of the recompute cost, so it
stops below that size: solving stays under a second."""

WIDE_LIMIT = 200
"""Fast-mode problems with at most this many ops whose fast search gave up on being exact (many
values live across its cuts: unrolled RNNs, DenseNet-style blocks) are searched over every
segment too, bounded the same way, and the cheaper plan wins; their bound is then taken over
every segment. The fast space's segments are short or anchored, and on such graphs the cheapest
plans have long segments: on seven of the solver bench's eight graphs of 35-165 ops, the search
over every segment plans with 12-44% less recompute, in 0.7-2.3 s more
(``docs/solver_graphs.md``). At 1,003 ops that search takes 36 s, and on a 243-op synthetic cell
it finds a dearer plan."""

Mode = Literal["auto", "exact", "fast"]
_EXACT = Space(exact=True)
_FAST = Space(exact=False)
_REFINE = Space(exact=False, ratio=0.01, front_size=64)
_REPAIRS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bound:
    """Why a plan came from the bounded heuristic, and how far from the best it may be."""

    work: int
    """Steps (entries extended) the exact search took before it gave up."""
    states: int
    """States at the cut where it gave up (values live across it, held or not)."""
    lower_bound: float
    """No plan the search considers, with a peak within the budget, recomputes less."""

    def gap(self, cost: float) -> float:
        """At most this share of ``cost`` could be saved: ``(cost - lower_bound) / cost``."""
        return gap(cost, self.lower_bound)

    def note(self, cost: float) -> str:
        """The plan note: what happened and the distance from the bound."""
        head = (f"solver: heuristic after {self.work:,} steps ({self.states} states at one "
                "cut); ")
        if self.lower_bound <= 0 < cost:
            return head + f"no lower bound above 0 found for its recompute ({cost:.4g})"
        return head + (f"recompute within {self.gap(cost):.1%} of the lower bound "
                       f"({self.lower_bound:.4g} for any plan searched, this plan {cost:.4g})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Solution:
    """A plan chosen for a budget."""

    segments: Spans
    """Recompute segments: sorted, non-overlapping ``(start, end)`` ranges over the ops."""
    predicted_peak: int
    """Peak activation bytes :func:`~fxckpt.solver.simulate.simulate` predicts for the plan."""
    recompute_cost: float
    """Total cost of the ops inside segments."""
    optimal: bool
    """True when the search covered every plan (``mode="exact"``): no plan is cheaper."""
    bound: Optional[Bound] = None
    """Set when the search gave up on being exact and a bounded heuristic chose the plan."""


class ParetoPoint(NamedTuple):
    """One point of the budget / peak / recompute trade-off curve."""

    budget: int
    """The budget asked for, in bytes."""
    predicted_peak: int
    """Simulated peak of the plan chosen for it (never above the budget)."""
    recompute_cost: float
    """Recompute cost of that plan."""
    segments: Spans = ()
    """That plan's segments."""


def _space(problem: Problem, mode: str) -> Space:
    if mode not in ("auto", "exact", "fast"):
        raise ValueError(f"mode must be 'auto', 'exact' or 'fast' (got {mode!r})")
    exact = mode == "exact" or (mode == "auto" and len(problem.ops) <= EXACT_LIMIT)
    return _EXACT if exact else _FAST


def _wide(problem: Problem, space: Space) -> bool:
    """Whether ``problem``, searched in ``space``, is searched over every segment too
    (:data:`WIDE_LIMIT`): known once the fast search has run."""
    return (not space.exact and problem.index.n <= WIDE_LIMIT
            and gave_up(problem.index, space) is not None)


def _judged(problem: Problem, space: Space) -> Space:
    """The space a plan searched in ``space`` is judged over (optimal, or how far from a
    bound): every segment where the search was widened (:func:`_wide`)."""
    return _EXACT if _wide(problem, space) else space


def _cheaper(a: Optional[Found], b: Optional[Found]) -> Optional[Found]:
    found = [f for f in (a, b) if f is not None]
    return min(found, key=lambda f: (f.cost, f.peak)) if found else None


def _check_budget(budget_bytes: object) -> int:
    ok = isinstance(budget_bytes, (int, float)) and not isinstance(budget_bytes, bool)
    if (
        not ok
        or not math.isfinite(budget_bytes)  # type: ignore[arg-type]
        or budget_bytes < 0  # type: ignore[operator]
    ):
        raise ValueError(f"budget_bytes must be a finite number >= 0 (got {budget_bytes!r})")
    return int(budget_bytes)  # type: ignore[call-overload]


def _verified(problem: Problem, found: Found) -> int:
    peak = peak_bytes(problem, found.segments)
    # The bounded pass may count bytes twice (never too few); the exact one is the simulator.
    if peak > found.peak or (found.exact and peak != found.peak):
        log.error("solver predicted peak %d but the simulator says %d for %s",
                  found.peak, peak, found.segments)
    return peak


def _search_cost(problem: Problem, space: Space, budget: int,
                 refine: bool = True) -> Optional[Found]:
    """Exact search; or a fast pass, refined under its cost when the problem is not huge."""
    ix = problem.index
    found = search(ix, space, budget)
    if _wide(problem, space):
        return _cheaper(found, search(ix, _EXACT, budget))
    if space.exact or found is None or not found.exact or not refine or ix.n > REFINE_LIMIT:
        return found
    refined = search(ix, _REFINE, budget, cost_cap=found.cost * (1 + 1e-9))
    return refined if refined is not None and refined.cost < found.cost else found


def solve(problem: Problem, budget_bytes: int, *, mode: Mode = "auto",
          refine: bool = True, bound: bool = True) -> Solution:
    """The least-recompute plan whose simulated peak is at most ``budget_bytes``.

    ``refine=False`` skips the second, finer pass of the fast search (about 40% of its time;
    callers that solve many budgets and keep only the plans' shapes use it). ``bound=False``
    skips the relaxed search that bounds a heuristic plan's cost (``Solution.bound`` is then
    None).

    Raises :class:`~fxckpt.solver.BudgetInfeasible` (a ``ValueError``) with the smallest
    feasible budget when no plan fits.
    """
    budget = _check_budget(budget_bytes)
    space = _space(problem, mode)
    target = budget
    for _ in range(_REPAIRS + 1):
        found = _search_cost(problem, space, target, refine)
        if found is None:
            break
        peak = _verified(problem, found)
        if peak <= budget:
            log.info("budget %d: %d segments, peak %d, recompute cost %g",
                     budget, len(found.segments), peak, found.cost)
            return _solution(problem, space, budget, found.segments, peak, found.cost, bound)
        target -= peak - budget
    low_segments, low = _min_peak_plan(problem, mode)
    if low <= budget and gave_up(problem.index, space) is not None:
        # The heuristic missed a plan that fits: the smallest-peak plan it found does.
        cost = sum(problem.index.segment_cost(s, e) for s, e in low_segments)
        return _solution(problem, space, budget, low_segments, low, cost, bound)
    raise BudgetInfeasible(budget, low)


def _solution(problem: Problem, space: Space, budget: int, segments: Spans, peak: int,
              cost: float, bound: bool) -> Solution:
    space = _judged(problem, space)
    where = gave_up(problem.index, space)
    return Solution(segments=segments, predicted_peak=peak, recompute_cost=cost,
                    optimal=space.exact and where is None,
                    bound=bound_for(problem, budget, mode="exact" if space.exact else "fast",
                                    cost=cost) if where is not None and bound else None)


def heuristic(problem: Problem, *, mode: Mode = "auto") -> bool:
    """Whether the exact search gave up on ``problem`` (its plans now come from the bounded
    heuristic)."""
    return gave_up(problem.index, _judged(problem, _space(problem, mode))) is not None


def bound_for(problem: Problem, budget_bytes: int, *, mode: Mode = "auto",
              cost: float = math.inf, priced: Optional[Problem] = None) -> Optional[Bound]:
    """Where the exact search gave up on ``problem``, a lower bound on the recompute cost of
    every plan it considers under ``budget_bytes`` (at most ``cost``); None where it never did.
    ``priced``: the same ops at lower costs, to take the bound on instead."""
    space = _judged(problem, _space(problem, mode))
    where = gave_up(problem.index, space)
    if where is None:
        return None
    # Capped at the plan's cost: entries dearer than it cannot lower the bound, and pruning
    # them leaves the relaxed pass's work to the rest. Nothing under the cap: the plan's cost.
    cap = cost * (1 + 1e-9) if math.isfinite(cost) else math.inf
    low = lower_bound((priced or problem).index, space, _check_budget(budget_bytes),
                      cost_cap=cap)
    return Bound(work=where.work, states=where.states,
                 lower_bound=min(cost, low) if low is not None else
                 (cost if math.isfinite(cost) else 0.0))


def _min_peak_plan(problem: Problem, mode: str) -> tuple[Spans, int]:
    space = _space(problem, mode)

    def make() -> tuple[Spans, int]:
        found = search(problem.index, space, math.inf, by_peak=True)
        plans = [found.segments if found is not None else ()]
        if _wide(problem, space):
            wide = search(problem.index, _EXACT, math.inf, by_peak=True)
            plans += [wide.segments] if wide is not None else []
        return min(((segs, peak_bytes(problem, segs)) for segs in plans), key=lambda p: p[1])

    return problem.index.memo.get(Key[tuple[Spans, int]]("min_peak", space), make)


def min_feasible_peak(problem: Problem, *, mode: Mode = "auto") -> int:
    """The smallest simulated peak any plan reaches (exact in ``mode="exact"``, else an upper
    bound that ``solve`` can always meet)."""
    return _min_peak_plan(problem, mode)[1]


def min_peak_segments(problem: Problem, *, mode: Mode = "auto") -> Spans:
    """The plan whose simulated peak is :func:`min_feasible_peak`."""
    return _min_peak_plan(problem, mode)[0]


def pareto(problem: Problem, points: int = 9, *, mode: Mode = "auto",
           refine: bool = True) -> list[ParetoPoint]:
    """Trade-off curve from the smallest feasible budget to the no-checkpoint peak.

    Budgets are evenly spaced. Each point is the cheapest plan found at *any* budget of the sweep
    that fits this one (ties: lower peak), so a smaller budget never gives a higher peak or a
    lower cost.
    """
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be a positive int (got {points!r})")
    low, high = min_feasible_peak(problem, mode=mode), peak_bytes(problem, ())
    budgets = sorted({low + (high - low) * k // max(1, points - 1) for k in range(points)})
    plans: list[tuple[float, int, Spans]] = [(0.0, high, ())]
    for budget in budgets:
        sol = solve(problem, budget, mode=mode, refine=refine, bound=False)
        plans.append((sol.recompute_cost, sol.predicted_peak, sol.segments))
    curve = []
    for budget in budgets:
        cost, peak, segments = min(plan for plan in plans if plan[1] <= budget)
        curve.append(ParetoPoint(budget, peak, cost, segments))
    return curve

"""Memory-budget planning as pure functions over plain data (no torch, no fx).

    problem = Problem(ops=(Op(name="mm", out_bytes=..., cost=..., inputs=("x",), saves=("x",)),
                           ...), outputs=("loss",))
    simulate(problem, segments=[(2, 5)])     # peak, recompute cost, event timeline
    solve(problem, budget_bytes=...)         # least recompute under a peak budget
                                             # (.bound: a heuristic's distance from the best)
    min_feasible_peak(problem); pareto(problem)

A bridge elsewhere turns an annotated ``torch.fx`` graph into a :class:`Problem`; everything here
can be tested with hand-made tables and checked against an exhaustive oracle.

The thresholds that trade solve time against plan quality (``EXACT_LIMIT``, ``REFINE_LIMIT``,
``bounds.LIMITS``, the selective and per-block solvers' sizes) were set on the benchmark machine;
``docs/tuning.md`` lists each with the bench command that checks it again.
"""

from fxckpt.solver.solve import (
    EXACT_LIMIT,
    Bound,
    ParetoPoint,
    Solution,
    min_feasible_peak,
    min_peak_segments,
    pareto,
    solve,
)
from fxckpt.errors import BudgetInfeasible
from fxckpt.solver.problem import Op, Problem, Spans, check_segments
from fxckpt.solver.simulate import Simulation, held_at_backward, peak_bytes, simulate

__all__ = [
    "Op",
    "Problem",
    "Spans",
    "BudgetInfeasible",
    "check_segments",
    "Simulation",
    "held_at_backward",
    "simulate",
    "peak_bytes",
    "Solution",
    "Bound",
    "ParetoPoint",
    "solve",
    "min_feasible_peak",
    "min_peak_segments",
    "pareto",
    "EXACT_LIMIT",
]

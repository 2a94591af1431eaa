"""Plans people write by hand, as starting points the budget search must beat.

A *start* is a named plan: segments and the ops it keeps inside them, as plain data
(per-block checkpointing, ``checkpoint_sequential``, torchtitan's op policy, Megatron's selective
recompute: the caller describes them, :mod:`fxckpt.planning.peers` on the graph side). The budget
search (:func:`fxckpt.solver.portfolio.solve_plan`) fits every start to the budget and takes the
cheapest plan of all, its own included, so it is never worse than a start by its own prices:

1. **Down to the budget.** A start over the budget gives up its kept groups, those saving the
   least per byte first, until it fits (bisection on how many it keeps); a start that does not
   fit with no kept op is left out.
2. **Up to the budget.** The memory left is spent twice, and the cheaper plan wins: on more kept
   groups (:func:`~fxckpt.solver.selective.keep_within`, the start's own kept groups pinned), and
   on leaving the last segments out (the last blocks' activations are the first backward needs:
   a plan that recomputes them is paying for memory it has), then filling the rest with kept
   groups.

Peaks are the simulator's, like every other plan's, and never above the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from fxckpt.solver.problem import Problem, Spans, check_segments
from fxckpt.solver.selective import Choices, Selection, _density, _inside, keep_within
from fxckpt.solver.simulate import peak_bytes

__all__ = ["Start", "fit_start", "fit_starts"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Start:
    """A hand-written plan: its name, its segments, and the op groups it keeps inside them."""

    name: str
    segments: Spans
    keep: Choices = ()
    """Groups of op positions (as :func:`keep_within`'s ``choices``) the plan keeps."""


def _fits_down(problem: Problem, segments: Spans, keep: list[tuple[int, ...]], budget: int
               ) -> Optional[list[tuple[int, ...]]]:
    """The densest prefix of ``keep`` (sorted densest first) whose plan fits; None if none."""
    flat = lambda groups: [j for g in groups for j in g]  # noqa: E731
    if peak_bytes(problem, segments, flat(keep)) <= budget:
        return keep
    if peak_bytes(problem, segments) > budget:
        return None
    lo, hi = 0, len(keep)  # keep[:lo] fits, keep[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_bytes(problem, segments, flat(keep[:mid])) <= budget:
            lo = mid
        else:
            hi = mid
    return keep[:lo]


def _fewer(problem: Problem, segments: Spans, budget: int) -> Spans:
    """``segments`` less as many of its last ones as can be left out with the peak (no kept op)
    within ``budget`` (bisection: leaving more out never lowers the peak)."""
    lo, hi = 0, len(segments)  # dropping lo fits; dropping more than hi is not tried
    if hi == 0 or peak_bytes(problem, segments) > budget:
        return segments
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_bytes(problem, segments[:len(segments) - mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return segments[:len(segments) - lo]


def fit_start(problem: Problem, start: Start, budget: int, choices: Choices,
              forced: Choices = ()) -> Optional[Selection]:
    """The cheapest plan found from ``start`` under ``budget`` (see the module docstring), or
    None when the start's segments do not fit with no kept op."""
    ix = problem.index
    segments = check_segments(start.segments, ix.n)
    allowed = {tuple(g) for g in (*choices, *forced)}
    recomputed = _inside(ix, segments)
    own = sorted((tuple(g) for g in start.keep if tuple(g) in allowed
                  and set(g) <= recomputed), key=lambda g: -_density(ix, g))
    kept = _fits_down(problem, segments, own, budget)
    if kept is None:
        return None
    found = [keep_within(problem, segments, budget, choices, [*forced, *kept])]
    fewer = _fewer(problem, segments, budget)
    if fewer != segments:
        found.append(keep_within(problem, fewer, budget, choices, forced))
    best = min((sel for sel in found if sel.predicted_peak <= budget),
               key=lambda sel: (sel.recompute_cost, sel.predicted_peak), default=None)
    return None if best is None else dataclasses.replace(best, origin=start.name)


def fit_starts(problem: Problem, starts: Sequence[Start], budget: int, choices: Choices,
               forced: Choices = ()) -> list[Selection]:
    """:func:`fit_start` for each start that fits (in the order given)."""
    out = []
    for start in starts:
        sel = fit_start(problem, start, budget, choices, forced)
        if sel is not None:
            out.append(sel)
    return out

"""Selective recompute: inside the segments, keep what is expensive to run again.

A segment plan recomputes every op of its segments. Most of the recompute *time* is a few ops (a
matmul writes one byte per ``K/2`` FLOPs, a GELU one per few), while most of the *memory* a
segment frees is everywhere. So after choosing segments, the planner may keep some ops' outputs
from forward (torch's selective checkpoint: the op is not run again, its cached output is used):
each kept op costs its output bytes from forward until its recompute step, and saves its cost.

Which ops may be kept is the caller's business (``choices``: groups of op positions kept
together, e.g. an op and the synthetic op standing for its hidden saved tensors; random ops and
ops whose output is written in place are left out by the bridge). Here:

* :func:`keep_within` fills a segment plan's memory slack under the budget with kept groups,
  most recompute cost saved per byte first (a greedy knapsack over the live-bytes profile: each
  group adds its bytes to a span of steps, checked against the budget span by span). On small
  problems with few candidates (:data:`EXACT_CHOICES`) every subset is tried.
* :func:`solve_selective` runs it on the solver's plan for the budget and on plans solved for
  tighter budgets (more recompute, more slack to keep the expensive ops in), and returns the
  cheapest. The segment-only plan is one of the candidates, so it is never worse than it.

Peaks are re-simulated with :func:`~fxckpt.solver.simulate.simulate` and never exceed the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

from fxckpt.solver.problem import Index, Key, Problem, Spans, check_segments
from fxckpt.solver.simulate import kept_span, peak_bytes, profile
from fxckpt.solver.solve import (Bound, Mode, bound_for, heuristic, min_feasible_peak,
                                 min_peak_segments, solve)

__all__ = ["Selection", "keep_within", "solve_selective", "EXACT_CHOICES", "TIGHTER"]

EXACT_CHOICES = 10
"""At most this many candidate groups inside a plan's segments of a small problem (at most
:data:`LOCAL_LIMIT` ops): every subset is tried (each one a full simulation: on a 600-op graph
that took seconds, so larger problems always use the greedy fill)."""

TIGHTER = (0.0,)
"""Tighter segment plans tried besides the budget's own, at ``low + f * (budget - low)``
(``low`` = the smallest feasible peak): they leave more room to keep their expensive ops in.
``f = 0`` is the smallest-peak plan (already solved for every budget plan). On
transformer-like problems of 158-1562 ops at budgets 0.3-0.9 of the eager peak it gave the
cheapest plan in 10 of 12 cases, ``f = 0.5`` (with keeping made free) in the others, by under
1% of a forward pass; that search took seconds on a 615-op GPT-2, so large problems skip it."""

TIGHTER_SMALL = (0.5, 0.0)
""":data:`TIGHTER` for problems of at most :data:`LOCAL_LIMIT` ops."""

LOCAL_LIMIT = 48
"""Problems with at most this many ops are also improved by local search (:func:`_improve`)."""

TWO_STEP_LIMIT = 12
"""Problems this small are searched two steps out at each step of :func:`_improve`."""

DISCOUNT = 1e-3
"""The share of a keepable op's cost the search still sees (ties go to plans recomputing less)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Selection:
    """A segment plan with the ops it keeps."""

    segments: Spans
    keep: tuple[int, ...]
    """Op positions inside the segments whose outputs are kept from forward (sorted)."""
    predicted_peak: int
    recompute_cost: float
    """The segments' cost less the cost of the kept ops."""
    bound: Optional[Bound] = None
    """Set when a bounded heuristic chose the segments (:attr:`Solution.bound`); its lower
    bound holds for kept ops too."""
    origin: str = ""
    """The hand-written plan this one was fitted from (:mod:`fxckpt.solver.starts`); ``""`` for
    the solver's own search."""


Choices = Sequence[tuple[int, ...]]


def _inside(ix: Index, segments: Spans) -> set[int]:
    """Positions of recomputed ops (an offloaded segment keeps everything already; ops past a
    segment's early stop are not run again)."""
    return {i for s, e in segments if not ix.segment_offloads(s, e)
            for i in range(s, ix.recompute_end(s, e))}


def _gain(ix: Index, group: tuple[int, ...]) -> float:
    return sum(ix.gain[j] for j in group)


def _density(ix: Index, group: tuple[int, ...]) -> float:
    size = sum(ix.out[j] for j in group)
    return _gain(ix, group) / size if size else float("inf")


def keep_within(problem: Problem, segments: object, budget: int,
                choices: Choices, forced: Choices = ()) -> Selection:
    """The groups of ``choices`` to keep inside ``segments`` so the peak stays within ``budget``,
    saving as much recompute cost as the search finds (exactly, for few candidates). Groups of
    ``forced`` inside the segments are kept whatever they cost (a user's pins)."""
    ix = problem.index
    segs = check_segments(segments, ix.n)
    inside = _inside(ix, segs)
    pinned = {j for g in forced if g and set(g) <= inside for j in g}
    groups = sorted((g for g in choices if g and set(g) <= inside and _gain(ix, g) > 0
                     and not set(g) & pinned), key=lambda g: -_density(ix, g))
    base = sum(ix.segment_cost(s, e) for s, e in segs)
    if len(groups) <= EXACT_CHOICES and ix.n <= LOCAL_LIMIT:
        keep = _best_subset(problem, segs, budget, groups, pinned)
    else:
        keep = _greedy(problem, segs, budget, groups, pinned)
    return Selection(segments=segs, keep=tuple(sorted(keep)),
                     predicted_peak=peak_bytes(problem, segs, keep),
                     recompute_cost=base - sum(ix.gain[j] for j in keep))


class _Live:
    """Live bytes per step, with range additions and range maxima in ``O(sqrt(steps))`` each
    (square-root decomposition): the greedy fill adds each candidate's bytes over its span,
    which runs from forward to backward, so a plain loop made the fill quadratic in the ops."""

    def __init__(self, live: list[int], size: int = 128) -> None:
        self.size = size
        self.parts = [live[i:i + size] for i in range(0, len(live), size)] or [[0]]
        self.lazy = [0] * len(self.parts)
        self.tops = [max(p) for p in self.parts]

    def add(self, lo: int, hi: int, value: int) -> None:
        if lo >= hi:
            return
        size = self.size
        b0, b1 = lo // size, (hi - 1) // size
        if b0 == b1:
            self._part(b0, lo - b0 * size, hi - b0 * size, value)
            return
        self._part(b0, lo - b0 * size, size, value)
        self._part(b1, 0, hi - b1 * size, value)
        if b1 > b0 + 1:  # whole parts: list comprehensions, not a Python loop per part
            self.lazy[b0 + 1:b1] = [x + value for x in self.lazy[b0 + 1:b1]]
            self.tops[b0 + 1:b1] = [x + value for x in self.tops[b0 + 1:b1]]

    def _part(self, b: int, lo: int, hi: int, value: int) -> None:
        part = self.parts[b]
        part[lo:hi] = [x + value for x in part[lo:hi]]
        self.tops[b] = max(part) + self.lazy[b]

    def max(self, lo: int, hi: int) -> int:
        if lo >= hi:
            return 0
        size = self.size
        b0, b1 = lo // size, (hi - 1) // size
        if b0 == b1:
            return max(self.parts[b0][lo - b0 * size:hi - b0 * size]) + self.lazy[b0]
        best = max(self.parts[b0][lo - b0 * size:]) + self.lazy[b0]
        best = max(best, max(self.parts[b1][:hi - b1 * size]) + self.lazy[b1])
        if b1 > b0 + 1:
            best = max(best, max(self.tops[b0 + 1:b1]))
        return best


def _greedy(problem: Problem, segs: Spans, budget: int,
            groups: list[tuple[int, ...]], pinned: set[int]) -> set[int]:
    ix = problem.index
    steps, sc = profile(problem, segs)
    live = _Live(steps)
    keep = set(pinned)
    for j in pinned:
        live.add(*kept_span(ix, sc, j), ix.out[j])
    if max(live.tops, default=0) > budget:
        return keep
    for group in groups:
        spans = [(*kept_span(ix, sc, j), ix.out[j]) for j in group]
        for lo, hi, size in spans:
            live.add(lo, hi, size)
        if all(live.max(lo, hi) <= budget for lo, hi, _ in spans):
            keep.update(group)
        else:
            for lo, hi, size in spans:  # does not fit: take it back
                live.add(lo, hi, -size)
    return keep


def _best_subset(problem: Problem, segs: Spans, budget: int,
                 groups: list[tuple[int, ...]], pinned: set[int]) -> set[int]:
    ix = problem.index
    best: tuple[float, set[int]] = (0.0, set(pinned))
    for r in range(1, len(groups) + 1):
        for subset in itertools.combinations(groups, r):
            keep = {j for g in subset for j in g} | pinned
            gain = sum(ix.gain[j] for j in keep)
            if gain > best[0] and peak_bytes(problem, segs, keep) <= budget:
                best = (gain, keep)
    return best[1]


def _free_keeps(problem: Problem, choices: Choices) -> Problem:
    """``problem`` with the keepable ops' cost cut to almost nothing: the search then puts them
    in segments freely, as a plan that keeps them would (their memory is put back by
    :func:`keep_within`)."""
    def make() -> Problem:  # cached with its own index (and that index's solver caches)
        keepable = {j for g in choices for j in g}
        ops = tuple(dataclasses.replace(op, cost=op.cost * DISCOUNT) if j in keepable else op
                    for j, op in enumerate(problem.ops))
        return dataclasses.replace(problem, ops=ops)

    return problem.index.memo.get(Key[Problem]("free keeps", tuple(choices)), make)


def _cheapest_keeps(problem: Problem, choices: Choices) -> Problem:
    """``problem`` with each keepable op costing what is left of it when it is kept."""
    def make() -> Problem:
        ix = problem.index
        keepable = {j for g in choices for j in g}
        ops = tuple(dataclasses.replace(op, cost=op.cost - max(0.0, ix.gain[j]))
                    if j in keepable else op for j, op in enumerate(problem.ops))
        return dataclasses.replace(problem, ops=ops)

    return problem.index.memo.get(Key[Problem]("cheapest keeps", tuple(choices)), make)


def solve_selective(problem: Problem, budget_bytes: int, choices: Choices,
                    forced: Choices = (), *, mode: Mode = "auto",
                    tighter: Optional[Sequence[float]] = None) -> Selection:
    """The cheapest segments-plus-kept-ops plan found whose simulated peak fits the budget.

    Candidates: the segment-only plan for the budget, and the plans for the budget and tighter
    ones of the problem where keeping is free (:func:`_free_keeps`), each filled with kept ops
    by :func:`keep_within`. Raises :class:`~fxckpt.solver.BudgetInfeasible` as
    :func:`~fxckpt.solver.solve` does (keeping ops never lowers a peak).
    """
    first = solve(problem, budget_bytes, mode=mode, bound=False)
    found = [keep_within(problem, first.segments, budget_bytes, choices, forced)]
    if choices:
        found += _tighter(problem, budget_bytes, choices, forced, mode, first.segments, tighter)
        if problem.index.n <= LOCAL_LIMIT:
            found = [_improve(problem, sel, budget_bytes, choices, forced) for sel in found]
    best = min(found, key=lambda sel: (sel.recompute_cost, sel.predicted_peak))
    # Keeping an op saves at most its gain: the bound is taken with every keepable op at its
    # cost less that gain, so it holds for plans with kept ops too.
    keepable = [*choices, *forced]
    bound = bound_for(problem, budget_bytes, mode=mode, cost=best.recompute_cost,
                      priced=_cheapest_keeps(problem, keepable) if keepable else None)
    return best if bound is None else dataclasses.replace(best, bound=bound)


def _tighter(problem: Problem, budget_bytes: int, choices: Choices, forced: Choices,
             mode: Mode, first: Spans,
             tighter: Optional[Sequence[float]]) -> list[Selection]:
    """Plans for tighter budgets (where keeping is free), filled with kept ops."""
    if tighter is None:
        tighter = TIGHTER_SMALL if problem.index.n <= LOCAL_LIMIT else TIGHTER
    if heuristic(problem, mode=mode):
        tighter = [f for f in tighter if f == 0]  # bounded searches: only the memoised one
    free = _free_keeps(problem, [*choices, *forced])
    low = min_feasible_peak(problem, mode=mode)
    tried, found = {first}, []
    for f in tighter:
        target = int(low + f * (budget_bytes - low))
        if target > budget_bytes:
            continue
        segments = (min_peak_segments(problem, mode=mode) if f == 0
                    else solve(free, target, mode=mode, bound=False).segments)
        if segments not in tried:
            tried.add(segments)
            found.append(keep_within(problem, segments, budget_bytes, choices, forced))
    return found


def _better(a: Selection, b: Selection) -> bool:
    return (a.recompute_cost, a.predicted_peak) < (b.recompute_cost, b.predicted_peak)


def _neighbours(segs: Spans, n: int) -> list[Spans]:
    """Plans one step away: a segment's end moved by one, split, merged with the next, dropped;
    or a one-op segment added."""
    out: list[list[tuple[int, int]]] = []
    for i, (s, e) in enumerate(segs):
        rest = list(segs[:i]) + list(segs[i + 1:])
        lo = segs[i - 1][1] if i else 0
        hi = segs[i + 1][0] if i + 1 < len(segs) else n
        out += [rest + [(a, b)] for a, b in ((s - 1, e), (s + 1, e), (s, e - 1), (s, e + 1))
                if lo <= a < b <= hi]
        out += [rest + [(s, k), (k, e)] for k in range(s + 1, e)]
        out.append(rest)
        if i + 1 < len(segs):
            out.append(rest[:i] + [(s, segs[i + 1][1])] + rest[i + 1:])
    taken = {i for s, e in segs for i in range(s, e)}
    out += [list(segs) + [(j, j + 1)] for j in range(n) if j not in taken]
    return [tuple(sorted(plan)) for plan in out]


def _improve(problem: Problem, best: Selection, budget: int, choices: Choices,
             forced: Choices) -> Selection:
    """Hill-climb over :func:`_neighbours` (small problems): the first plans miss segments that
    only pay off once their expensive ops are kept."""
    n = problem.index.n
    for _ in range(4 * n):
        near = set(_neighbours(best.segments, n))
        if n <= TWO_STEP_LIMIT:
            near |= {far for segs in near for far in _neighbours(segs, n)}
        found = min((keep_within(problem, segs, budget, choices, forced) for segs in near),
                    key=lambda sel: (sel.predicted_peak > budget, sel.recompute_cost,
                                     sel.predicted_peak), default=best)
        if found.predicted_peak > budget or not _better(found, best):
            return best
        best = found
    return best

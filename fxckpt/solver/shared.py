"""Repeated blocks solved once: a plan for a stack of identical layers at the cost of one layer.

Real models are stacks of identical blocks (transformer layers, the blocks of a ResNet stage).
The full search (:mod:`fxckpt.solver.search`) treats their ops as unrelated, and its time grows
faster than the graph. Here a *family* is a set of op ranges with the same structure (each op's
bytes, cost, gradient bytes, and which ops of its own block, or which outside value, it reads and
saves: :func:`structure`). For each family:

1. one representative block becomes a problem of its own (its inputs from outside are graph
   inputs; what later ops read are its outputs) and its trade-off curve is solved once
   (:func:`~fxckpt.solver.solve.pareto`: local plans from the smallest peak to none);
2. the ``k``-th local plan is copied into every block of the family (optionally all but the
   last ``m`` blocks, whose activations backward needs first), every family at the same point
   of its curve;
3. each such whole-model plan is simulated (:func:`~fxckpt.solver.simulate.peak_bytes`, linear in
   the ops), and the cheapest that fits the budget is filled with kept ops like any other plan
   (:func:`~fxckpt.solver.selective.keep_within`).

The ops outside every family (embeddings, the head, the loss) are not put in segments. The work
is one block's solve plus ``O(points)`` linear simulations: linear in the ops. Plans are exact
by the simulator, like the full search's; only their cost may be above the full search's (the
full search may mix plans across blocks and segment the head).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

from fxckpt.errors import BudgetInfeasible
from fxckpt.solver.families import MIN_COPIES, block_problem, families, structure
from fxckpt.solver.problem import Key, Problem, Span, Spans
from fxckpt.solver.selective import Choices, Selection, keep_within
from fxckpt.solver.simulate import peak_bytes
from fxckpt.solver.solve import ParetoPoint, pareto

__all__ = ["families", "structure", "solve_shared", "min_peak_shared", "SHARED_FROM", "ALONE_FROM",
           "MIN_COPIES", "POINTS"]

ALONE_FROM = 300
"""Problems with at least this many ops and a family of repeated blocks are solved per block
only; smaller ones also by the full search, and the cheaper plan wins. The full search takes
seconds from a few hundred ops on (a 12-layer GPT-2 has 615: 2-4 s against 0.3-0.5 s for the
per-block solve, at the same recompute within 4% on the benchmark's models)."""

SHARED_FROM = 1500
"""From this many ops on, fewer plans are filled and mixed (:data:`FILLED_LARGE`)."""

POINTS = 12
"""Points of each representative block's trade-off curve (solved without the fast search's
refining pass). 24 refined points found the same plans on the benchmark's GPT-2, BERT and
Llama-style models (within 1%) in about twice the time."""

FILLED = 6
"""The cheapest fitting plans (by segment cost) that are filled with kept ops and compared."""
MIXED = 2
"""The cheapest fitting uniform plans that are also mixed with lighter points."""

FILLED_LARGE, MIXED_LARGE = 2, 1
""":data:`FILLED` and :data:`MIXED` from :data:`SHARED_FROM` ops on, where each simulation and
each fill costs tens of milliseconds (20,000 ops: 6.3 s with 6 and 2, the fills and the mixes'
simulations two thirds of it)."""

GROUPS = (2, 3, 4)
"""Whole blocks per segment in the first blocks of a grouped plan (:func:`_grouped`)."""

TAILS = (0, 1)
"""Variants of every plan: copied into all blocks, or into all but the last one."""


WINDOW = 3
"""Blocks in the window whose plans are solved (the middle block's part is the pattern)."""


def _patterns(problem: Problem, window: Span, blocks: Sequence[Span]) -> list[Spans]:
    """For each point of the trade-off curve of ``window`` (ops solved as a problem of their
    own, once per window) and each of ``blocks`` (relative to the window's start), the segments
    starting in that block, relative to its start (a segment may run on into the next block)."""
    points = problem.index.memo.get(
        Key[list[ParetoPoint]]("window points", window),
        lambda: pareto(block_problem(problem, window), POINTS, refine=False))
    out: list[Spans] = []
    for point in points:
        for lo, hi in blocks:
            local = tuple((a - lo, b - lo) for a, b in point.segments if lo <= a < hi)
            if local not in out:
                out.append(local)
    return out


def _curves(problem: Problem, fams: list[list[Span]], period: int = 1
            ) -> list[list[Spans]]:
    """Each family's local plans, from the smallest peak to none (relative to a block's start):
    the middle block's part of plans solved for a window of :data:`WINDOW` adjacent blocks
    (what crosses into the next block included), and plans solved for one block alone.

    With ``period=2`` a family's blocks are pairs of layers (:func:`pairs`): its local plans are
    the parts of the same one-layer windows' plans that start in their first two layers."""
    def make() -> list[list[Spans]]:
        curves = []
        for fam in fams:
            s, e = fam[0]
            if period == 2:
                layer = (e - s) // 2
                seen = _patterns(problem, (s, s + WINDOW * layer), [(0, e - s)])
            else:
                seen = _patterns(problem, fam[0], [(0, e - s)])
            adjacent = all(a[1] == b[0] for a, b in zip(fam, fam[1:]))
            if period == 1 and adjacent and len(fam) >= WINDOW + 1:
                inner = [(a - s, b - s) for a, b in fam[:WINDOW]]
                window = (fam[0][0], fam[WINDOW - 1][1])
                seen += [p for p in _patterns(problem, window, inner) if p not in seen]
            if () not in seen:
                seen.append(())
            ix = problem.index
            seen.sort(key=lambda local: -sum(ix.segment_cost(s + a, min(s + b, ix.n))
                                             for a, b in local))  # most recompute first
            curves.append(seen)
        return curves

    key = Key[list[list[Spans]]]("shared curves", (tuple(tuple(f) for f in fams), period))
    return problem.index.memo.get(key, make)


def _copies(fam: list[Span], local: Spans, tail: int, n: int) -> list[Span]:
    """``local`` copied into each block of ``fam`` but the last ``tail``; a segment running into
    the next block is cut where the next copy starts (or at the problem's end)."""
    out: list[Span] = []
    blocks = fam[:len(fam) - tail]
    for i, (s, _) in enumerate(blocks):
        for a, b in local:
            start, end = s + a, min(s + b, n)
            if out and start < out[-1][1]:
                continue
            if end > start:
                out.append((start, end))
    return out


_Plan = tuple[Spans, float, int, int]
"""A whole-model plan: (segments, recompute cost, curve point ``k``, tail)."""


def _segments(problem: Problem, fams: list[list[Span]], locals_: list[tuple[Spans, ...]],
              tail: int) -> tuple[Spans, float]:
    """One whole-model plan: each family's blocks get their own local plan (``locals_[f][i]``
    for block ``i``), all but the last ``tail``; and its recompute cost (no simulation)."""
    segs: list[Span] = []
    for fam, per_block in zip(fams, locals_):
        for i, block in enumerate(fam[:len(fam) - tail]):
            segs += _copies([block], per_block[i], 0, problem.index.n)
    plan = _disjoint(sorted(segs))
    return plan, sum(problem.index.segment_cost(a, b) for a, b in plan)


def _peak(problem: Problem, segs: Spans) -> int:
    """The simulated peak of ``segs``, each plan simulated once."""
    peaks = problem.index.memo.get(Key[dict[Spans, int]]("shared peaks"), dict)
    if segs not in peaks:
        peaks[segs] = peak_bytes(problem, segs)
    return peaks[segs]


def _point(curve: list[Spans], k: int, steps: int) -> Spans:
    return curve[round(k * (len(curve) - 1) / max(steps - 1, 1))]


def _uniform(problem: Problem, fams: list[list[Span]], period: int = 1) -> list[_Plan]:
    """Every uniform whole-model plan the curves give, cheapest first (not yet simulated)."""
    def make() -> list[_Plan]:
        curves = _curves(problem, fams, period)
        steps = max(len(c) for c in curves)
        plans: dict[Spans, _Plan] = {}
        for k in range(steps):
            for tail in TAILS:
                locals_ = [(_point(c, k, steps),) * len(f) for f, c in zip(fams, curves)]
                segs, cost = _segments(problem, fams, locals_, tail)
                plans.setdefault(segs, (segs, cost, k, tail))
        return sorted(plans.values(), key=lambda p: p[1])

    key = Key[list[_Plan]]("shared plans", (tuple(tuple(f) for f in fams), period))
    return problem.index.memo.get(key, make)


def _mixed(problem: Problem, fams: list[list[Span]], budget: int,
           uniform: list[_Plan], period: int = 1) -> list[Spans]:
    """Mixes of two points of the largest family's curve: for each of the ``uniform`` plans
    (at point ``k``), the first ``j`` blocks at ``k`` and the rest at a lighter point (``k + 1``,
    or no segments), with the smallest ``j`` that fits (bisection: more blocks at ``k`` never
    raise the peak much)."""
    curves = _curves(problem, fams, period)
    steps = max(len(c) for c in curves)
    big = max(range(len(fams)), key=lambda f: len(fams[f]))
    size = len(fams[big])
    out = []
    for _, _, k, tail in uniform:
        if k + 1 >= steps:
            continue
        locals_ = [(_point(c, k, steps),) * len(f) for f, c in zip(fams, curves)]
        heavy = _point(curves[big], k, steps)
        for light in {_point(curves[big], k + 1, steps), ()}:

            def mix(j: int) -> Spans:
                locals_[big] = (heavy,) * j + (light,) * (size - j)
                return _segments(problem, fams, locals_, tail)[0]

            out += _fewest(problem, budget, mix, 0, size)
    return out


def _fewest(problem: Problem, budget: int, plan: Callable[[int], Spans], lo: int,
            hi: int) -> list[Spans]:
    """The plans ``plan(j)`` that fit on the way to the smallest ``j`` in ``lo..hi`` that fits
    (bisection: a larger ``j`` is taken to fit whenever a smaller one does)."""
    fits = []
    while lo < hi:
        j = (lo + hi) // 2
        segs = plan(j)
        if _peak(problem, segs) <= budget:
            fits.append(segs)
            hi = j
        else:
            lo = j + 1
    return fits


def _grouped(problem: Problem, fams: list[list[Span]], budget: int,
             uniform: list[_Plan], period: int = 1) -> list[Spans]:
    """For each of the ``uniform`` plans (at point ``k``): the first ``j`` blocks of the largest
    family in segments of :data:`GROUPS` whole blocks (the first from the graph's start, or the
    family's), the rest at any lighter point (or none), the smallest ``j`` that fits. Backward
    reaches the first blocks last, when little else is held: recomputing them wholesale lets
    later blocks keep more, and early stops make long segments cheap per block."""
    curves = _curves(problem, fams, period)
    steps = max(len(c) for c in curves)
    big = max(range(len(fams)), key=lambda f: len(fams[f]))
    fam = sorted(fams[big])
    size = len(fam)
    out = []
    for _, _, k, tail in uniform:
        locals_ = [(_point(c, k, steps),) * len(f) for f, c in zip(fams, curves)]
        lights = {_point(curves[big], m, steps) for m in range(k + 1, steps)} | {()}
        for light in lights:
            locals_[big] = (light,) * size
            rest = _segments(problem, fams, locals_, tail)[0]
            for group, start in itertools.product(GROUPS, {0, fam[0][0]}):

                def grouped(j: int) -> Spans:
                    head = [(fam[a][0] if a else start, fam[min(a + group, j) - 1][1])
                            for a in range(0, j, group)]
                    return _disjoint(sorted([*head, *(r for r in rest if r[0] >= fam[j - 1][1])]))

                out += _fewest(problem, budget, grouped, 1, size)
    return out


def _disjoint(segs: list[Span]) -> Spans:
    out: list[Span] = []
    for a, b in segs:
        if not out or a >= out[-1][1]:
            out.append((a, b))
    return tuple(out)


def min_peak_shared(problem: Problem, blocks: Sequence[Span]) -> Optional[tuple[Spans, int]]:
    """The shared plan with the smallest simulated peak, and that peak; None without families
    (every uniform plan of every period :func:`solve_shared` tries is simulated)."""
    found = [p for cut, period in _periods(problem, blocks)
             if (p := _min_peak_period(problem, cut, period))]
    return min(found, key=lambda p: p[1]) if found else None


def _min_peak_period(problem: Problem, blocks: Sequence[Span], period: int = 1
                     ) -> Optional[tuple[Spans, int]]:
    fams = families(problem, blocks)
    if not fams:
        return None
    return min(((p[0], _peak(problem, p[0])) for p in _uniform(problem, fams, period)),
               key=lambda p: p[1])


def _periods(problem: Problem, blocks: Sequence[Span]) -> list[tuple[list[Span], int]]:
    """The ways of cutting the graph into blocks that are solved, with their period: one layer
    at a time, and below :data:`SHARED_FROM` ops also two (:func:`pairs`)."""
    periods = [(list(blocks), 1)]
    two = pairs(blocks) if problem.index.n < SHARED_FROM else []
    if len(two) >= MIN_COPIES:
        periods.append((two, 2))
    return periods


def pairs(blocks: Sequence[Span]) -> list[Span]:
    """Consecutive adjacent blocks merged two by two (a period of two layers)."""
    ordered = sorted(blocks)
    return [(a[0], b[1]) for a, b in zip(ordered[::2], ordered[1::2]) if a[1] == b[0]]


def solve_shared(problem: Problem, budget_bytes: int, blocks: Sequence[Span],
                 choices: Choices = (), forced: Choices = ()) -> Optional[Selection]:
    """The cheapest shared plan whose simulated peak fits, with kept ops filled in; None without
    families. Raises :class:`BudgetInfeasible` (with the smallest shared peak) when none fits.

    On graphs below :data:`SHARED_FROM` ops the plans may also repeat every two layers
    (:func:`pairs`; their local plans come from the same solved windows, so this costs
    simulations, not solves), and the cheaper plan wins: on the benchmark's Llama-style model at
    0.3 of its peak, one layer at a time cost 6% more recompute than the full search, two at a
    time 0.6% less."""
    found: list[Selection] = []
    smallest: Optional[BudgetInfeasible] = None
    for cut, period in _periods(problem, blocks):
        try:
            sel = _solve_period(problem, budget_bytes, cut, period, choices, forced)
        except BudgetInfeasible as e:  # the first of the smallest
            smallest = min(smallest or e, e, key=lambda x: x.min_budget)
            continue
        if sel is not None:
            found.append(sel)
    if found:
        return min(found, key=lambda sel: (sel.recompute_cost, sel.predicted_peak))
    if smallest is not None:
        raise smallest
    return None


def _solve_period(problem: Problem, budget_bytes: int, blocks: Sequence[Span], period: int,
                  choices: Choices, forced: Choices) -> Optional[Selection]:
    """:func:`solve_shared` for one way of cutting the graph into blocks.

    Uniform plans are simulated cheapest first, until :data:`FILLED` fit; the :data:`MIXED`
    cheapest of them are mixed with lighter points; the :data:`FILLED` cheapest of all (and, on
    graphs below :data:`SHARED_FROM` ops, the smallest-peak plan) are filled with kept ops
    (:data:`FILLED_LARGE` and :data:`MIXED_LARGE` on larger graphs)."""
    fams = families(problem, blocks)
    if not fams:
        return None
    ix = problem.index
    filled, mixed = (FILLED, MIXED) if ix.n < SHARED_FROM else (FILLED_LARGE, MIXED_LARGE)
    fitting: list[_Plan] = []
    for plan in _uniform(problem, fams, period):
        if _peak(problem, plan[0]) <= budget_bytes:
            fitting.append(plan)
            if len(fitting) == filled:
                break
    if not fitting:
        least = _min_peak_period(problem, blocks, period)
        assert least is not None
        raise BudgetInfeasible(budget_bytes, least[1])
    candidates = {p[0]: p[1] for p in fitting}
    for segs in _mixed(problem, fams, budget_bytes, fitting[:mixed], period):
        candidates[segs] = sum(ix.segment_cost(a, b) for a, b in segs)
    if ix.n < SHARED_FROM and problem.early_stop:
        for segs in _grouped(problem, fams, budget_bytes, fitting[:mixed], period):
            candidates[segs] = sum(ix.segment_cost(a, b) for a, b in segs)
    tried = set(sorted(candidates, key=lambda segs: candidates[segs])[:filled])
    if ix.n < SHARED_FROM:
        least = _min_peak_period(problem, blocks, period)
        assert least is not None
        tried.add(least[0])
    found = [keep_within(problem, segs, budget_bytes, choices, forced) for segs in sorted(tried)]
    return min(found, key=lambda sel: (sel.recompute_cost, sel.predicted_peak))

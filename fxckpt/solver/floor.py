"""The recompute floor: a lower bound on what any plan must recompute to meet a peak.

Every plan the simulator scores (segments, kept ops inside them, segments offloaded) runs the
forward as the unmodified step does and differs only in what it lets go of. At a step ``t`` the
unmodified step holds ``E_t`` bytes, and a plan holds at least ``E_t`` less the bytes of the
values it *drops* there: values the unmodified step still holds at ``t`` that the plan does not.
Only an op inside a segment, neither kept nor past its segment's early stop, can be dropped:

* a value outside every segment stays held by whatever saves it (an op outside segments saves it
  until its own backward; a segment that reads it keeps it as a segment input);
* a kept op's value is held from forward by definition;
* an op past its segment's early stop saves nothing in that segment, so a value it produces is
  held only by ops outside the segment, which hold it in every plan alike.

In forward (and at backward start) the dropped values are those whose last reader has run; at
the backward of op ``k`` those whose segment lies wholly before ``k`` (a value ``k`` saves never
is). Each dropped value's op is run again (its cost, and the saved-tensor hooks it pays inside a
segment) or its segment is offloaded (its bytes at the offload price), and it brings companions
(:func:`_items`): its segment holds its inputs, and the ops that save it are in its segment. A
plan with any segment pays the segment overhead at least once. So for a peak of at most ``B``,
with ``h_i`` the bytes item ``i`` drops at ``t`` and ``c_i`` the least it costs::

    recompute  >=  min  sum_i c_i x_i   over 0 <= x_i <= 1  with  sum_i h_i x_i >= E_t - B

a fractional knapsack, solved greedily by price per byte: a relaxation of every plan, so never
above the cheapest. The largest such bound over the steps tried is :func:`recompute_floor`. It
holds for every plan however it was made (a hand-written policy, ``every=``, the search), needs
no search (0.15 s at 20,000 ops), and is the *certificate* a plan's gap is measured against.
It is loose where what a recomputed value brings back during backward decides the peak: on
random 6-op graphs the floor is a median 0.56 of the cheapest plan (exhaustive search).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fxckpt.solver.problem import Problem
from fxckpt.solver.simulate import held_at_backward, profile

__all__ = ["recompute_floor", "gap"]


@dataclasses.dataclass(frozen=True)
class _Prices:
    """Per op, the least a plan pays for it, and what the unmodified step holds at backward."""

    drop: list[float]
    """For dropping its value: run again with its hooks, or its bytes moved to the host and
    back where the problem may offload."""
    inside: list[float]
    """For being in a segment for a later op's sake (offloaded, an op nothing saves moves
    nothing)."""
    kept: list[float]
    """For being kept inside a segment: the keep price and its hooks."""
    held: tuple[int, ...]
    """Bytes of its value the unmodified step holds at backward start."""


def _prices(problem: Problem) -> _Prices:
    ix = problem.index
    hooks = [ix.hooks(j, j + 1) for j in range(ix.n)]
    per_byte = ix.offload_per_byte
    drop = [ix.cost[j] + hooks[j] if per_byte is None
            else min(ix.cost[j], per_byte * ix.out[j]) + hooks[j] for j in range(ix.n)]
    inside = [ix.cost[j] + hooks[j] if per_byte is None
              else min(ix.cost[j], per_byte * ix.out[j] * bool(ix.savers[j])) + hooks[j]
              for j in range(ix.n)]
    kept = [min(ix.cost[j], problem.keep_overhead) + hooks[j] for j in range(ix.n)]
    return _Prices(drop, inside, kept, held_at_backward(problem))


WAYS = 4
"""Companions of one dropped value whose every choice (held or run) gets an item of its own;
past that, one item counts them free, which only lowers the bound."""


def _items(problem: Problem, dropped: list[int], prices: _Prices, dead: Callable[[int], bool],
           savers_to: int) -> list[tuple[float, float]]:
    """Knapsack items ``(cost, bytes)`` for the values ``dropped`` at a step.

    A dropped value comes with *companions*. Its segment holds its inputs from forward to its
    backward, and every op that saves it (up to ``savers_to``) is in its segment, or it would
    hold it. A companion the unmodified step still holds costs the least the segment charges
    for it (run again, or kept), unless it may be dropped itself (its own item counts it). One
    the unmodified step no longer holds (``dead``) is either held again (kept, or an input held
    by the segment: its bytes off the value's) or run again (its cost added): one item per
    choice of each, and taking several items of one value is allowed, which only lowers the
    bound. A companion shared by several dropped values is charged to each in equal parts, so
    no choice counts it more than once in all.
    """
    ix = problem.index
    candidates = set(dropped)
    companions: dict[int, list[tuple[int, bool]]] = {}
    sharers: dict[int, int] = {}
    for j in dropped:
        own = [(u, False) for u in ix.touches[j] if ix.out[u] and dead(u)]
        own += [(i, True) for i in ix.savers[j] if j < i <= savers_to and i not in candidates]
        companions[j] = own
        for c, _ in own:
            sharers[c] = sharers.get(c, 0) + 1
    items: list[tuple[float, float]] = []
    for j in dropped:
        base, ways = prices.drop[j], [(0.0, 0.0)]
        for c, saver in companions[j]:
            share = 1 / sharers[c]
            run = 0.0 if saver and problem.early_stop else prices.inside[c]
            hold = prices.kept[c] if saver else 0.0
            if dead(c) and len(companions[j]) <= WAYS:
                ways = [(cost + option, size + held) for cost, size in ways
                        for option, held in ((hold * share, ix.out[c] * share),
                                             (run * share, 0.0))]
            else:  # held anyway (or too many ways): only what the segment charges
                base += min(run, hold) * share
        items += [(base + cost, ix.out[j] - size) for cost, size in ways if ix.out[j] > size]
    return items


def _knapsack(need: float, items: list[tuple[float, float]]) -> float:
    """The least cost of ``items`` ``(cost, bytes)``, taken in fractions, that adds up to
    ``need`` bytes (``inf`` when all of them do not)."""
    if need <= 0:
        return 0.0
    total = 0.0
    for cost, size in sorted(items, key=lambda it: it[0] / it[1]):
        if size >= need:
            return total + cost * need / size
        total += cost
        need -= size
    return float("inf")


STEPS = 16
"""The unmodified step's fullest steps the bound is taken at (with backward start)."""


def _dropped(problem: Problem, t: int, held: tuple[int, ...]
             ) -> tuple[list[int], Callable[[int], bool]]:
    """Ops whose values the unmodified step holds at step ``t`` and a plan may have let go of,
    and which values the unmodified step no longer holds at ``t`` (``held``: the bytes it holds
    at backward start).

    In forward (and at backward start, ``t = n``): those held for backward whose last reader
    ran before ``t``. At the backward of op ``k``: those an op in ``j..k-1`` saves and ``k``
    does not (a value ``k`` saves is held for ``k``'s backward in every plan: outside segments,
    as a segment input, or recomputed with ``k``; a plan holds the others again only when ``j``
    is in ``k``'s segment, which the bound does not ask).
    """
    ix = problem.index
    n = ix.n
    if t <= n:
        return ([j for j in range(min(t + 1, n))
                 if held[j] and not ix.is_output[j] and ix.last_use[j] < t],
                lambda u: not held[u] and ix.last_alive[u] < t)
    k = 2 * n - t  # the unmodified backward runs op n-1 at step n+1, op k at step 2n-k
    return ([j for j in range(k) if ix.out[j] and ix.first_saver[j] <= k
             and k not in ix.savers[j]],
            lambda u: ix.first_saver[u] > k)


def recompute_floor(problem: Problem, peak: int) -> float:
    """No plan whose simulated peak is at most ``peak`` recomputes less than this (in the units
    of ``Op.cost``; ``inf`` when no plan can drop enough, 0 when the unmodified step fits).

    The bound is taken at backward start and at the unmodified step's :data:`STEPS` fullest
    steps (forward or backward), the largest wins.
    """
    ix = problem.index
    live, _ = profile(problem, ())
    if max(live, default=0) <= peak or ix.n == 0:
        return 0.0
    prices = _prices(problem)
    fullest = sorted(range(len(live)), key=lambda t: (-live[t], t))[:STEPS]
    best = 0.0
    for t in sorted({ix.n, *fullest}):
        dropped, dead = _dropped(problem, t, prices.held)
        savers_to = ix.n if t <= ix.n else 2 * ix.n - t - 1
        bound = _knapsack(live[t] - peak, _items(problem, dropped, prices, dead, savers_to))
        best = max(best, bound + (ix.overhead if bound > 0 else 0.0))
    return best


def gap(cost: float, floor: float) -> float:
    """The share of ``cost`` a plan might still save against ``floor``: ``(cost - floor) /
    cost`` (0 for a plan that costs nothing or meets its floor)."""
    if cost <= 0 or floor >= cost:
        return 0.0
    return (cost - floor) / cost

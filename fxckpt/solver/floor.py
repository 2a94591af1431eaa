"""The recompute floor: a lower bound on what any plan must recompute to meet a peak.

Every plan the simulator scores (segments, kept ops inside them, segments offloaded) runs the
forward as the unmodified step does and differs only in what it lets go of. At a step ``t`` of
the forward (or at backward start, ``t = n``) the unmodified step holds ``E_t`` bytes, and a plan
holds at least ``E_t`` less the bytes of the values it *drops* there: values the unmodified step
still holds at ``t`` that the plan frees after their last forward reader. Only an op inside a
segment, neither kept nor past its segment's early stop, can be dropped:

* a value outside every segment stays held by whatever saves it (an op outside segments saves it
  until its own backward; a segment that reads it keeps it as a segment input);
* a kept op's value is held from forward by definition;
* an op past its segment's early stop saves nothing in that segment, so a value it produces is
  held only by ops outside the segment, which hold it in every plan alike.

Each dropped value's op is run again (its cost, and the saved-tensor hooks it pays inside a
segment), or its segment is offloaded (its bytes at the offload price), and a plan with any
segment pays the segment overhead at least once. So for a peak of at most ``B``, with
``h_j`` the bytes op ``j`` drops at ``t`` and ``c_j`` the least it can cost::

    recompute  >=  min  sum_j c_j x_j   over 0 <= x_j <= 1  with  sum_j h_j x_j >= E_t - B

a fractional knapsack, solved greedily by price per byte. The largest such bound over the steps
tried is :func:`recompute_floor`; it holds for every plan, however it was made (a hand-written
policy, ``every=``, the search), and needs no search: it is the *certificate* a plan's gap is
measured against. It is loose where the cheap bytes cannot be dropped alone (a value whose
readers' segment must also run a dear op) and where the overheads dominate.
"""

from __future__ import annotations

from fxckpt.solver.problem import Problem
from fxckpt.solver.simulate import held_at_backward, profile

__all__ = ["recompute_floor", "gap"]


def _prices(problem: Problem) -> list[float]:
    """The least op ``j`` costs a plan that drops its value: run again with its hooks, or its
    bytes moved to the host and back where the problem may offload."""
    ix = problem.index
    prices = []
    for j in range(ix.n):
        own = ix.cost[j] + ix.hooks(j, j + 1)
        if ix.offload_per_byte is not None:
            own = min(own, ix.offload_per_byte * ix.out[j] + ix.hooks(j, j + 1))
        prices.append(own)
    return prices


def _knapsack(need: int, items: list[tuple[float, int]]) -> float:
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


def _droppable(problem: Problem, t: int) -> list[int]:
    """Ops whose values the unmodified step holds at step ``t`` and a plan may have let go of:
    in forward (and at backward start, ``t = n``) those held for backward whose last reader ran
    before ``t``; at the backward of op ``k`` those an op in ``j..k`` saves (a plan holds them
    again only when ``j`` is in ``k``'s segment, which the bound does not ask)."""
    ix = problem.index
    n = ix.n
    if t <= n:
        held = held_at_backward(problem)
        return [j for j in range(min(t + 1, n))
                if held[j] and not ix.is_output[j] and ix.last_use[j] < t]
    k = 2 * n - t  # the unmodified backward runs op n-1 at step n+1, op k at step 2n-k
    return [j for j in range(k) if ix.out[j] and ix.first_saver[j] <= k]


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
        bound = _knapsack(live[t] - peak, [(prices[j], ix.out[j])
                                           for j in _droppable(problem, t)])
        best = max(best, bound + (ix.overhead if bound > 0 else 0.0))
    return best


def gap(cost: float, floor: float) -> float:
    """The share of ``cost`` a plan might still save against ``floor``: ``(cost - floor) /
    cost`` (0 for a plan that costs nothing or meets its floor)."""
    if cost <= 0 or floor >= cost:
        return 0.0
    return (cost - floor) / cost

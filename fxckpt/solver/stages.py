"""Contiguous stage partitioning as pure functions over plain lists (no torch, no fx).

A pipeline runs K stages at once, so a step takes as long as its slowest stage. Given the cost of
every node in topological order, :func:`partition` cuts the order into K contiguous, non-empty
runs so that the largest run cost is as small as possible -- exactly, not greedily:

    costs   3  1  4  1  5  9  2  6        K = 3
            [3  1  4  1  5][9][2  6]      max(14, 9, 8) = 14   <- a greedy fill can do worse
            [3  1  4  1][5  9][2  6]      max( 9,14, 8) = 14
            [3  1  4  1  5][9  2][6]      ...                   the DP returns the minimum

The DP over stage count k and end position p is

    best[k][p] = min over cuts q < p of  max(best[k-1][q], S[p] - S[q])

with prefix sums S. For non-negative costs, ``best[k-1][q]`` grows with q and ``S[p]-S[q]``
shrinks, so the minimising q is where the two cross: a binary search makes the whole DP
O(K * n log n). ``allowed`` restricts where a cut may go (never between a multi-output op and
its ``getitem``, never inside a checkpoint segment); the bridge in ``fxckpt.pipeline.partition``
decides that.

Explicit ``balance`` lists (node counts per stage, as in torchgpipe) are checked by
:func:`check_balance`; every error is a ``ValueError`` that states the rule and the value seen.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Iterable, Optional, Sequence

__all__ = ["Partition", "partition", "partition_from_balance", "check_balance", "check_costs",
           "stage_costs", "cuts_to_bounds"]


@dataclasses.dataclass(frozen=True)
class Partition:
    """K contiguous stages over n nodes."""

    n: int
    """Number of nodes partitioned."""
    cuts: tuple[int, ...]
    """K-1 increasing positions; stage s covers ``[bounds[s], bounds[s+1])``."""
    costs: tuple[float, ...]
    """The summed cost of each stage."""

    @property
    def bounds(self) -> tuple[int, ...]:
        """``(0, *cuts, n)``."""
        return cuts_to_bounds(self.cuts, self.n)

    @property
    def bottleneck(self) -> float:
        """The slowest stage's cost: what the pipeline's clock is set by."""
        return max(self.costs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of nodes per stage."""
        b = self.bounds
        return tuple(b[i + 1] - b[i] for i in range(len(b) - 1))


def cuts_to_bounds(cuts: Sequence[int], n: int) -> tuple[int, ...]:
    """``(2, 5)`` over 8 nodes -> ``(0, 2, 5, 8)``."""
    return (0, *cuts, n)


def stage_costs(costs: Sequence[float], cuts: Sequence[int]) -> tuple[float, ...]:
    """The summed cost of each stage for these cuts."""
    b = cuts_to_bounds(cuts, len(costs))
    return tuple(float(sum(costs[b[i]:b[i + 1]])) for i in range(len(b) - 1))


def check_costs(costs: Sequence[float]) -> None:
    """Costs must be finite non-negative numbers (the DP's monotonicity relies on it)."""
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(
                f"node costs must be finite non-negative numbers (got {c!r} at position {i})"
            )


def _check_stages(stages: object, n: int, n_allowed: int) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"the number of stages must be a positive integer (got {stages!r})")
    if stages > n:
        raise ValueError(
            f"cannot cut {n} node(s) into {stages} non-empty stages: use at most {n} stages"
        )
    if stages - 1 > n_allowed:
        raise ValueError(
            f"{stages} stages need {stages - 1} cut points but only {n_allowed} positions may be "
            f"cut (of {n} nodes); use at most {n_allowed + 1} stages"
        )
    return stages


def _allowed_positions(n: int, allowed: Optional[Iterable[int]]) -> list[int]:
    if allowed is None:
        return list(range(1, n))
    return sorted({p for p in allowed if 0 < p < n})


def partition(
    costs: Sequence[float], stages: int, allowed: Optional[Iterable[int]] = None
) -> Partition:
    """Cut ``costs`` into ``stages`` contiguous runs minimising the largest run's cost.

    ``allowed`` lists the positions ``p`` (1..n-1) where a stage may start; default: all.
    Among equally good partitions the DP returns one deterministically.
    """
    check_costs(costs)
    n = len(costs)
    ends = _allowed_positions(n, allowed)
    _check_stages(stages, n, len(ends))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    points = ends + [n]  # stage ends, as positions; the last stage ends at n
    best = [prefix[p] for p in points]  # one stage covering [0, p)
    choice: list[list[int]] = []
    for k in range(2, stages + 1):
        best, back = _next_layer(points, best, prefix, first_feasible=k - 2)
        choice.append(back)
    cuts = _trace_back(points, choice)
    return Partition(n=n, cuts=cuts, costs=stage_costs(costs, cuts))


def _next_layer(points: list[int], prev: list[float], prefix: list[float],
                first_feasible: int) -> tuple[list[float], list[int]]:
    """best[k][p] from best[k-1]; ``first_feasible``: the first q index with k-1 stages ending at
    q."""
    inf = math.inf
    out, back = [inf] * len(points), [-1] * len(points)
    for pi in range(first_feasible + 1, len(points)):
        lo, hi = first_feasible, pi  # candidate q indices in [lo, hi)
        # first q where prev[q] >= S[p]-S[q]; prev grows and the tail shrinks with q
        q = _crossing(prev, prefix, points, pi, lo, hi)
        for cand in (q - 1, q):
            if lo <= cand < hi:
                value = max(prev[cand], prefix[points[pi]] - prefix[points[cand]])
                if value < out[pi]:
                    out[pi], back[pi] = value, cand
    return out, back


def _crossing(
    prev: list[float], prefix: list[float], points: list[int], pi: int, lo: int, hi: int
) -> int:
    """The first q in [lo, hi) with ``prev[q] >= S[p] - S[q]`` (hi if none)."""
    return bisect.bisect_left(_Crossing(prev, prefix, points, prefix[points[pi]]), True, lo, hi)


class _Crossing:
    """A lazy boolean sequence ``prev[q] >= S[p] - S[q]`` (False...False True...True) for bisect.
    """

    def __init__(
        self, prev: list[float], prefix: list[float], points: list[int], end: float
    ) -> None:
        self.prev, self.prefix, self.points, self.end = prev, prefix, points, end

    def __getitem__(self, q: int) -> bool:
        return self.prev[q] >= self.end - self.prefix[self.points[q]]

    def __len__(self) -> int:
        return len(self.prev)


def _trace_back(points: list[int], choice: list[list[int]]) -> tuple[int, ...]:
    cuts: list[int] = []
    idx = len(points) - 1
    for back in reversed(choice):
        idx = back[idx]
        cuts.append(points[idx])
    return tuple(reversed(cuts))


def check_balance(balance: object, n: int) -> tuple[int, ...]:
    """Validate an explicit list of node counts per stage; return it as a tuple.

    Rules: a non-empty list of integers, each >= 1, summing to ``n`` (the graph's node count).
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, (list, tuple)) or not balance:
        raise ValueError(
            f"balance must be a non-empty list of node counts per stage (got {balance!r})"
        )
    for i, b in enumerate(balance):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(
                f"balance entries must be integers >= 1, one per stage (got {b!r} for stage {i} "
                f"in {list(balance)})"
            )
    total = sum(balance)
    if total != n:
        raise ValueError(
            f"balance must sum to the graph's {n} compute node(s) (got {list(balance)}, which "
            f"sums to {total})"
        )
    return tuple(balance)


def partition_from_balance(costs: Sequence[float], balance: object,
                           allowed: Optional[Iterable[int]] = None) -> Partition:
    """The partition an explicit node-count ``balance`` describes, checked against ``allowed``
    cuts."""
    check_costs(costs)
    sizes = check_balance(balance, len(costs))
    cuts = tuple(sum(sizes[:i + 1]) for i in range(len(sizes) - 1))
    if allowed is not None:
        legal = set(_allowed_positions(len(costs), allowed))
        bad = [c for c in cuts if c not in legal]
        if bad:
            raise ValueError(
                f"balance {list(sizes)} cuts at node position(s) {bad}, where a stage may not "
                f"start (inside a multi-output op or a checkpoint segment); legal positions are "
                f"{sorted(legal)}"
            )
    return Partition(n=len(costs), cuts=cuts, costs=stage_costs(costs, cuts))

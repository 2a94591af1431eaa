"""Which blocks the search may place, and their facts, cached per problem and search space.

A plan is a sequence of blocks. In an exact space every op is a cut position and a segment may
span any range. A fast space makes the search linear in the number of ops:

* a run of *null* ops (no bytes, no cost, nothing saved: views, getitems) is one unit block,
  so a cut falls before or after the run, and no segment starts with a null op;
* a *short* segment starts at any op that is not null and ends at any cut up to ``short`` real
  ops later (the cut before a null run only when the run reads something older than the
  segment: otherwise taking the run into the segment changes nothing);
* a *long* segment runs between *anchors* (cheap cuts, see :func:`~fxckpt.solver.tables.anchors`)
  and may end at any of the next ``reach`` anchors.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterator

from fxckpt.solver.problem import Index, Key
from fxckpt.solver.tables import Profiles, SegmentFacts, SegmentWalker, anchors

__all__ = ["Space", "Moves", "moves", "profiles"]


@dataclasses.dataclass(frozen=True)
class Space:
    """Which plans the search considers, and how much it may thin its fronts."""

    exact: bool
    """Every segment, unbounded fronts: the optimum of the cost model."""
    short: int = 10
    """A segment may end at any cut up to this many real (not null) ops after its start."""
    spacing: int = 8
    """Minimum distance between anchors, in ops."""
    reach: int = 24
    """A long segment may end at any of the next ``reach`` anchors after its start anchor."""
    hull: bool = True
    """Fronts keep their lower convex hull (the Lagrangian-optimal entries)."""
    ratio: float = 0.05
    """... and entries whose objective falls by at least this fraction from the last kept."""
    grain: float = 0.0
    """... and by at least this fraction of the objective's scale (cost cap or total; peak)."""
    front_size: int = 32
    """The spread part is thinned further (ratio doubled) until at most this many remain."""


def profiles(ix: Index) -> Profiles:
    """The problem's :class:`Profiles`, cached on its index."""
    return ix.memo.get(Key[Profiles]("profiles"), lambda: Profiles.build(ix))


def _is_null(ix: Index, k: int) -> bool:
    return ix.out[k] == 0 and ix.cost[k] == 0 and not ix.saves[k] and ix.grad[k] == 0


class Moves:
    """Cut positions, group extents, segment ends per start, and segment facts."""

    def __init__(self, ix: Index, prof: Profiles, space: Space) -> None:
        self.ix, self.prof, self.space = ix, prof, space
        self.facts: dict[tuple[int, int], SegmentFacts] = {}
        self.walkers: dict[int, SegmentWalker] = {}
        n = ix.n
        null = [_is_null(ix, k) for k in range(n)]
        if space.exact:
            self.positions = list(range(n))
        else:
            self.positions = [p for p in range(n) if p == 0 or not null[p] or not null[p - 1]]
        bounds = self.positions + [n]
        self.group_end = {p: q for p, q in zip(bounds, bounds[1:])}
        self.ends: dict[int, tuple[int, ...]] = {}
        if not space.exact:
            marks = anchors(ix, prof, space.spacing, 4 * space.spacing, allowed=set(bounds))
            real = [k for k, p in enumerate(self.positions) if not null[p]] + [len(bounds) - 1]
            # A segment needs to stop before a run of null ops only when the run reads a value
            # from before the segment (it would make the segment keep that value).
            self._oldest = {p: min((j for k in range(p, q) for j in ix.touches[k]), default=n)
                            for p, q in self.group_end.items() if null[p]}
            self.ends = {p: self._ends(k, bounds, marks, real) if not null[p] else ()
                         for k, p in enumerate(self.positions)}

    def _ends(self, k: int, bounds: list[int], marks: tuple[int, ...],
              real: list[int]) -> tuple[int, ...]:
        """Cuts up to the ``short``-th next real op, then the next anchors if ``k`` is one."""
        r = bisect.bisect_left(real, k)
        last = real[min(r + self.space.short, len(real) - 1)]
        start = bounds[k]
        out = [q for q in bounds[k + 1: last + 1] if self._oldest.get(q, -1) < start]
        i = bisect.bisect_left(marks, bounds[k])
        if i < len(marks) and marks[i] == bounds[k]:
            j = bisect.bisect_right(marks, out[-1])
            out += marks[j: j + self.space.reach]
        return tuple(out)

    def candidates(self, p: int) -> Iterator[SegmentFacts]:
        """Facts of every segment starting at ``p``, shortest first."""
        ends = range(p + 1, self.ix.n + 1) if self.space.exact else self.ends[p]
        for q in ends:
            yield self.get(p, q)

    def get(self, p: int, q: int) -> SegmentFacts:
        """Facts of segment ``[p, q)`` (walked once, then cached)."""
        facts = self.facts.get((p, q))
        if facts is None:
            walker = self.walkers.get(p)
            if walker is None or walker.end > q:
                walker = self.walkers[p] = SegmentWalker(self.ix, self.prof, p)
            while walker.end < q:
                walker.advance()
            facts = self.facts[(p, q)] = walker.facts()
        return facts


def moves(ix: Index, space: Space) -> Moves:
    """The cached :class:`Moves` of ``space`` for this problem."""
    space = dataclasses.replace(space, hull=False, ratio=0.0, grain=0.0, front_size=0)
    return ix.memo.get(Key[Moves]("moves", space), lambda: Moves(ix, profiles(ix), space))

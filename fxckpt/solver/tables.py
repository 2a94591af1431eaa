"""Plan-independent profiles and per-segment facts the search reads in O(1).

The simulator's peak decomposes (see :mod:`fxckpt.solver.search`) into terms that depend on the
plan only through which values are *held* for backward, plus terms that depend on one block of
the plan alone. This module computes the second kind once per problem:

* ``trans[t]``: forward bytes alive at step ``t`` if nothing were held for backward
  (every value lives from its op to its last reader; outputs until backward start).
* ``grad_live[i]``: gradient bytes alive during op ``i``'s backward; ``grad_gap[e]``: gradient
  bytes alive while a segment ending at ``e`` is recomputed. Gradient windows do not depend on the
  plan, because recomputation never reorders backward steps.
* ``crossing[p]``: bytes of values produced before ``p`` and read at or after ``p`` (the price of
  a cut there); used to pick anchors for long segments.
* :class:`SegmentWalker`: for a fixed segment start ``p``, extends the end op by op and keeps
  the segment's external inputs (``keeps``), its forward peak term, and a monotone lower bound of
  its backward peak term, each in O(degree) per op. The exact recompute-phase term needs one
  O(length) pass per segment (:func:`recompute_phase`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fxckpt.solver.problem import Index

__all__ = ["Profiles", "SegmentFacts", "SegmentWalker", "recompute_phase", "local_peak", "anchors"]


def _prefix(diff: list[int], length: int) -> tuple[int, ...]:
    out, run = [], 0
    for k in range(length):
        run += diff[k]
        out.append(run)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Profiles:
    """Per-position byte profiles that hold for every plan."""

    trans: tuple[int, ...]
    grad_live: tuple[int, ...]
    grad_gap: tuple[int, ...]
    """Indexed by segment end ``e`` in ``1..n`` (entry 0 is 0)."""
    crossing: tuple[int, ...]
    """Indexed by cut position ``0..n``."""
    ended_at: tuple[tuple[int, ...], ...]
    """Non-output values whose last reader is op ``t``."""
    first_saved_by: tuple[tuple[int, ...], ...]
    """Values whose first saver is op ``i``."""
    backward_start: int
    """Bytes that only exist at backward start: outputs and their gradients."""

    @staticmethod
    def build(ix: Index) -> "Profiles":
        n = ix.n
        trans, glive, ggap, cross = ([0] * (n + 2) for _ in range(4))
        ended: list[list[int]] = [[] for _ in range(n)]
        saved: list[list[int]] = [[] for _ in range(n)]
        for j in range(n):
            o, g, gf = ix.out[j], ix.grad[j], ix.grad_from[j]
            trans[j] += o
            trans[ix.last_alive[j] + 1] -= o
            if g:
                glive[j] += g
                glive[min(gf, n - 1) + 1] -= g
                ggap[j + 1] += g
                ggap[gf + 1] -= g
            if ix.last_use[j] > j:
                cross[j + 1] += o
                cross[ix.last_use[j] + 1] -= o
                if not ix.is_output[j]:
                    ended[ix.last_use[j]].append(j)
            if ix.first_saver[j] < n:
                saved[ix.first_saver[j]].append(j)
        outs = [j for j in range(n) if ix.is_output[j]]
        return Profiles(
            trans=_prefix(trans, n),
            grad_live=_prefix(glive, n),
            grad_gap=_prefix(ggap, n + 1),
            crossing=_prefix(cross, n + 1),
            ended_at=tuple(tuple(e) for e in ended),
            first_saved_by=tuple(tuple(s) for s in saved),
            backward_start=sum(ix.out[j] + ix.grad[j] for j in outs),
        )


@dataclasses.dataclass
class SegmentFacts:
    """What the search needs to know about one segment ``[start, end)``."""

    start: int
    end: int
    cost: float
    keeps: tuple[int, ...]
    """Values produced before ``start`` that the segment reads: checkpoint keeps them."""
    forward: int
    """Max over its forward steps of ``trans[t]`` + bytes of kept values already dead at ``t``."""
    backward_lb: int
    """Max over its backward steps of recomputed-and-saved bytes + gradients (monotone in end)."""
    local: int = -1
    """Exact peak of its recompute and backward above what the rest of the plan holds."""


class SegmentWalker:
    """Extends a segment starting at ``start`` one op at a time (O(degree) per op)."""

    def __init__(self, ix: Index, prof: Profiles, start: int) -> None:
        self.ix, self.prof, self.start, self.end = ix, prof, start, start
        self._keeps: list[int] = []
        self._keepset: set[int] = set()
        self._dead_kept = 0
        self._forward = 0
        self._saved = 0
        self._backward = 0

    def advance(self) -> None:
        """Add op ``end`` to the segment."""
        ix, prof, p, q = self.ix, self.prof, self.start, self.end
        for j in ix.touches[q]:
            if j < p and j not in self._keepset:
                self._keepset.add(j)
                self._keeps.append(j)
        self._forward = max(self._forward, prof.trans[q] + self._dead_kept)
        for j in prof.ended_at[q]:
            if j < p:
                self._dead_kept += ix.out[j]
        for j in prof.first_saved_by[q]:
            if j >= p:
                self._saved += ix.out[j]
        self._backward = max(self._backward, self._saved + prof.grad_live[q])
        self.end = q + 1

    def facts(self) -> SegmentFacts:
        """Facts of the current segment ``[start, end)`` (``local`` left to be computed)."""
        return SegmentFacts(
            start=self.start, end=self.end, cost=self.ix.segment_cost(self.start, self.end),
            keeps=tuple(self._keeps), forward=self._forward, backward_lb=self._backward)


def recompute_phase(ix: Index, start: int, end: int) -> int:
    """Peak bytes of the segment's own values while it is recomputed (O(length + edges))."""
    m = end - start
    diff = [0] * (m + 1)
    for j in range(start, end):
        o = ix.out[j]
        if not o:
            continue
        last = m - 1 if ix.first_saver[j] < end else j - start
        if last < m - 1:
            for k in ix.touchers[j]:
                if k >= end:
                    break
                last = k - start
        diff[j - start] += o
        diff[last + 1] -= o
    best = run = 0
    for x in range(m):
        run += diff[x]
        if run > best:
            best = run
    return best


def local_peak(ix: Index, prof: Profiles, facts: SegmentFacts) -> int:
    """Fill and return ``facts.local``: max(recompute phase + gradients, backward phase)."""
    if facts.local < 0:
        rec = recompute_phase(ix, facts.start, facts.end) + prof.grad_gap[facts.end]
        facts.local = max(rec, facts.backward_lb)
    return facts.local


def anchors(ix: Index, prof: Profiles, spacing: int, radius: int,
            allowed: Optional[set[int]] = None) -> tuple[int, ...]:
    """Cheap cut positions, at least ``spacing`` apart, where long segments may start and end.

    A position qualifies when its crossing bytes are within 25% of the smallest crossing bytes
    within ``radius`` positions (and is in ``allowed``); the cheapest are taken first. Long
    segments between anchors are what the search needs at tight budgets (a whole block
    recomputed, keeping only its residual input), so anchors sit where little crosses.
    """
    n, c = ix.n, prof.crossing
    # The ends (nothing crosses them) are anchors anyway; they must not hide inner minima.
    ok = [p for p in range(1, n) if (allowed is None or p in allowed)
          and c[p] * 4 <= 5 * min(c[max(1, p - radius): min(n - 1, p + radius) + 1])]
    taken: list[int] = []
    blocked = bytearray(n + 1)
    for p in sorted(ok, key=lambda p: (c[p], p)):
        if not blocked[p]:
            taken.append(p)
            for k in range(max(0, p - spacing + 1), min(n, p + spacing - 1) + 1):
                blocked[k] = 1
    return tuple(sorted(set(taken) | {0, n}))

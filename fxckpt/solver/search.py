"""Dynamic programme over cut positions whose peak is exactly the simulator's.

Why a DP works: walk the plan as blocks left to right, each block either ops outside segments
("unit") or one segment. Call a value *held* when something keeps it for backward (a unit op
saving it, or a later segment reading it). The simulated peak is the largest of

    forward step t of a unit op:    trans[t] + closed(t)
    forward steps of a segment:     facts.forward + closed(p)
    backward of a unit op t:        H(t) + grad_live[t]
    recompute/backward of segment:  H(p) + facts.local
    backward start:                 held bytes that are not outputs + outputs + output grads

where ``H`` = bytes held by the blocks up to and including the current one, and ``closed(t)`` =
held non-output bytes whose last reader ran before ``t``. Everything else depends on one block
only (:mod:`fxckpt.solver.tables`). So the state after a prefix of blocks is the cut position,
the set ``A`` of values crossing the cut that are already held (so a later block does not count
them twice), and the held output bytes; what remains to compare is ``H`` and the objective. Every
future term grows with ``H``, so an entry with no larger ``H`` and no worse objective dominates:
each state keeps a Pareto front of ``(H, objective)``.

With every cut and unbounded fronts (an exact :class:`~fxckpt.solver.moves.Space`) the search
finds the true optimum of the cost model. A fast space places fewer blocks and thins each front
to its lower convex hull plus entries spread apart in objective (:func:`_thin`). Thinning never
drops a state's smallest-``H`` entry, and the state a move leads to depends only on the state and
the move, so whenever some plan of the space fits the budget the search still finds one.

Where many values stay live across cuts the states multiply; the search then gives up on being
exact and a bounded pass answers, with a relaxed pass to bound its cost (:mod:`.bounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import operator
from typing import Iterator, Optional

from fxckpt.errors import Exhausted
from fxckpt.solver.bounds import (
    LIMITS, GaveUp, Limits, State as _State, limit, pareto_front, relax,
)
from fxckpt.solver.moves import Moves, Space, moves, profiles
from fxckpt.solver.problem import Index, Key, Spans
from fxckpt.solver.tables import local_peak

__all__ = ["Found", "search", "lower_bound", "gave_up"]

# An entry: (H, objective, tie-break, parent entry, (block start, block end, is segment)).
_Entry = tuple
_Key = tuple  # (A: frozenset of held crossing values, held output bytes)
_ORDER = operator.itemgetter(0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Found:
    """A plan and the DP's own accounting of it."""

    segments: Spans
    peak: int
    """The DP's peak: the simulator's, or (``exact=False``) at least the simulator's."""
    cost: float
    exact: bool = True
    """False when found by the bounded pass (its accounting may count some bytes twice)."""
    work: int = 0
    """The work of the passes that found it (see :class:`~fxckpt.solver.bounds.Limits`)."""


def _lower_hull(front: list[_Entry]) -> list[_Entry]:
    """Entries on the lower convex hull of (H, objective): the minimisers of
    ``objective + price * H`` over all prices (a Pareto front is the input)."""
    hull: list[_Entry] = []
    for e in front:
        while len(hull) >= 2:
            (h1, c1), (h2, c2) = hull[-2][:2], hull[-1][:2]
            if (c2 - c1) * (e[0] - h1) >= (e[1] - c1) * (h2 - h1):
                hull.pop()
            else:
                break
        hull.append(e)
    return hull


def _spread(front: list[_Entry], ratio: float, grain: float) -> list[_Entry]:
    """Keep an entry only when its objective is below ``(1 - ratio)`` times the last kept one's
    minus ``grain``. A dropped entry's plans fall back to the kept neighbour with less ``H``,
    so feasibility is never lost and each drop costs at most that gap."""
    kept: list[_Entry] = []
    best = math.inf
    for e in front:
        if e[1] < best:
            kept.append(e)
            best = e[1] * (1.0 - ratio) - grain
    return kept


def _thin(front: list[_Entry], space: Space, grain: float) -> list[_Entry]:
    """Bounded front: the lower hull plus entries spread in objective, at most about
    ``space.front_size``."""
    if len(front) <= 2 or space.exact:
        return front
    ratio = space.ratio
    kept = _spread(front, ratio, grain)
    while space.front_size and len(kept) > space.front_size:
        ratio = max(2 * ratio, 0.01)
        kept = _spread(front, ratio, grain)
    if space.hull:
        kept = sorted({id(e): e for e in kept + _lower_hull(front)}.values(), key=_ORDER)
    if kept[-1] is not front[-1]:
        kept.append(front[-1])
    return kept


STEP = 8
"""Work counted for one state made, or one state and move tried, against one entry extended
(in time: a few microseconds against half of one)."""

Mode = str
"""``"exact"``: the search as designed, giving up past its :class:`Limits`; ``"bounded"``: the
heuristic pass (pessimistic merging); ``"relaxed"``: the lower-bound pass (optimistic)."""


class _Search:
    """One run of the DP for one budget and objective.

    An entry's objective is the cost and its tie-break the peak so far, or the other way round
    when minimising the peak.
    """

    def __init__(self, ix: Index, space: Space, budget: float, by_peak: bool,
                 cost_cap: float, limits: Limits = LIMITS, mode: Mode = "exact",
                 kept: int = 1) -> None:
        self.ix, self.space, self.budget, self.by_peak = ix, space, budget, by_peak
        self.limits, self.mode, self.work, self.kept = limits, mode, 0, kept
        self.capped = False
        """Whether ``kept`` bound the states somewhere (a pass keeping more would differ)."""
        self.cost_cap = math.inf if by_peak else cost_cap
        self.prof = profiles(ix)
        self.moves: Moves = moves(ix, space)
        if by_peak:
            scale = float(max(self.prof.trans, default=0))
        else:
            scale = cost_cap if math.isfinite(cost_cap) else ix.cum_cost[-1]
        self.grain = space.grain * scale
        # Per cut: state key (held crossing values, held output bytes) -> (offset, entries).
        self.fronts: dict[int, dict[_Key, tuple[int, list[_Entry]]]] = {0: {
            (frozenset(), 0): (0, [(0, 0.0, 0, None, (0, 0, False))])}}

    def _states(self, p: int) -> list[_State]:
        states = []
        relaxed = self.mode == "relaxed"
        for (held, hout), (offset, entries) in self.fronts.pop(p, {}).items():
            front = pareto_front(entries)
            kept = _thin(front, self.space, self.grain)
            states.append(_State(held, hout, offset, relax(front, kept) if relaxed else kept))
        self.work += STEP * len(states)
        return states

    def _limit(self, k: int, p: int, states: list[_State]) -> list[_State]:
        """The exact pass gives up past its limits; the others share their work out."""
        limits = self.limits
        if self.mode == "exact":
            # Give up on too many states, or on work running ahead of a linear share of the
            # budget (a large graph is seen to be too large a tenth of the way in).
            allowed = limits.work * ((k + 1) / len(self.moves.positions) + 0.125)
            if len(states) > limits.states or self.work > min(allowed, limits.work):
                raise Exhausted(GaveUp(self.work, len(states)))
        else:
            count = self.ix.n - p if self.space.exact else len(self.moves.ends[p])
            left = len(self.moves.positions) - k
            share = (limits.bounded_work - self.work) // left
            states, work, capped = limit(self.ix, states, count + 1, share, limits, self.kept,
                                         self.mode == "relaxed")
            self.work += STEP * work
            self.capped |= capped
        for st in states:
            st.index(self.ix)
        return states

    def _target(self, st: _State, q: int, new: list[int]) -> list[_Entry]:
        ix = self.ix
        held, live = st.crossing(q)
        alive = [j for j in new if ix.last_use[j] >= q]
        if alive:
            held = held.union(alive)
        hout = st.hout + sum(ix.out[j] for j in new if ix.is_output[j])
        slot = self.fronts.setdefault(q, {})
        got = slot.get((held, hout))
        if got is None:
            offset = hout + live + sum(ix.out[j] for j in alive if not ix.is_output[j])
            got = slot[(held, hout)] = (offset, [])
        return got[1]

    def _push(self, st: _State, move: tuple[int, int, bool], new: list[int], bw: int, fw: int,
              cost: float) -> None:
        """Extend every entry of ``st`` with ``move`` where the budget is kept.

        ``bw``: backward term above ``H`` before the move; ``fw``: forward term above closed(p).
        """
        dh = sum(self.ix.out[j] for j in new)
        bw += dh
        fw -= st.closed_offset
        thr = min(self.budget - bw, self.budget - fw)
        target: Optional[list[_Entry]] = None
        cap = self.cost_cap - cost
        by_peak = self.by_peak
        keep_parent = self.mode != "relaxed"
        pushed = 0
        for e in st.entries:
            h = e[0]
            if h > thr:
                break
            lhs = h + bw if bw >= fw else h + fw
            if by_peak:
                obj, tie = (e[1] if e[1] >= lhs else lhs), e[2] + cost
            else:
                if e[1] > cap:
                    continue
                obj, tie = e[1] + cost, (e[2] if e[2] >= lhs else lhs)
            if target is None:
                target = self._target(st, move[1], new)
            target.append((h + dh, obj, tie, e if keep_parent else None, move))
            pushed += 1
        self.work += pushed + STEP

    def _unit(self, p: int, states: list[_State]) -> None:
        """Ops ``p`` .. group end outside segments (the group's other ops are null ops)."""
        ix, prof = self.ix, self.prof
        end = self.moves.group_end[p]
        move = (p, end, False)
        bw = max(prof.grad_live[p:end])
        for st in states:
            new = [j for j in ix.saves[p] if j not in st.held]
            fw, closing = prof.trans[p], 0
            for t in range(p + 1, end):
                for j in prof.ended_at[t - 1]:
                    if j in st.held or j in new:
                        closing += ix.out[j]
                fw = max(fw, prof.trans[t] + closing)
            self._push(st, move, new, bw, fw, 0.0)

    def _segments(self, p: int, states: list[_State]) -> None:
        min_h = min(st.entries[0][0] for st in states)
        min_closed = min(st.entries[0][0] - st.closed_offset for st in states)
        min_cost = 0.0 if self.by_peak else min(st.entries[-1][1] for st in states)
        for f in self.moves.candidates(p):
            if min_h + f.backward_lb > self.budget or min_closed + f.forward > self.budget \
                    or min_cost + f.cost > self.cost_cap:
                break
            local = local_peak(self.ix, self.prof, f)
            if min_h + local > self.budget:
                continue
            move = (p, f.end, True)
            for st in states:
                new = [j for j in f.keeps if j not in st.held]
                self._push(st, move, new, local, f.forward, f.cost)

    def run(self) -> Optional[Found]:
        for k, p in enumerate(self.moves.positions):
            states = [st for st in self._states(p) if st.entries]
            if states:
                states = self._limit(k, p, states)
                self._unit(p, states)
                self._segments(p, states)
        return self._finish()

    def _finish(self) -> Optional[Found]:
        best: Optional[tuple[tuple[float, float], _Entry, int, float]] = None
        start = self.prof.backward_start
        for (_, hout), (_, entries) in self.fronts.get(self.ix.n, {}).items():
            for e in entries:
                at_start = e[0] - hout + start
                if at_start > self.budget:
                    continue
                cost, peak = (e[2], e[1]) if self.by_peak else (e[1], e[2])
                peak = max(peak, at_start)
                value = (peak, cost) if self.by_peak else (cost, peak)
                if best is None or value < best[0]:
                    best = (value, e, peak, cost)
        if best is None:
            return None
        return Found(segments=_segments_of(best[1]), peak=best[2], cost=best[3],
                     exact=self.mode == "exact", work=self.work)


def _segments_of(entry: Optional[_Entry]) -> Spans:
    segs = []
    while entry is not None and entry[3] is not None:
        start, end, is_segment = entry[4]
        if is_segment:
            segs.append((start, end))
        entry = entry[3]
    return tuple(reversed(segs))


def gave_up(ix: Index, space: Space, limits: Limits = LIMITS) -> Optional[GaveUp]:
    """Where the exact pass of ``space`` gave up on this problem (``None``: it never did)."""
    return ix.memo.find(_gave_up_key(space, limits))


def _gave_up_key(space: Space, limits: Limits) -> Key[GaveUp]:
    return Key[GaveUp]("gave up", (space, limits))


def search(ix: Index, space: Space, budget: float, *, by_peak: bool = False,
           cost_cap: float = math.inf, limits: Limits = LIMITS) -> Optional[Found]:
    """Cheapest plan (or, ``by_peak``, lowest-peak plan) with peak <= ``budget``, or None.

    The exact pass runs first unless it already gave up on this problem and space; past its
    ``limits`` the bounded pass answers instead (``Found.exact`` is then False). ``budget`` and
    ``Found.peak`` count the problem's reserve, as the simulator's peaks do; the passes below
    walk the tensors only.
    """
    found = _search(ix, space, budget - ix.reserve, by_peak, cost_cap, limits)
    return dataclasses.replace(found, peak=found.peak + ix.reserve) if found else None


def _search(ix: Index, space: Space, budget: float, by_peak: bool, cost_cap: float,
            limits: Limits) -> Optional[Found]:
    if ix.n == 0:
        return Found(segments=(), peak=0, cost=0.0) if budget >= 0 else None
    with _no_gc():
        if gave_up(ix, space, limits) is None:
            try:
                return _Search(ix, space, budget, by_peak, cost_cap, limits).run()
            except Exhausted as e:
                assert isinstance(e.where, GaveUp)
                ix.memo.put(_gave_up_key(space, limits), e.where)
        found = []
        sizes = sorted(limits.kept)
        if by_peak:  # the smallest peak (feasibility, not cost): one pass, the middle size
            sizes = sizes[len(sizes) // 2:][:1]
        for k in sizes:
            run = _Search(ix, space, budget, by_peak, cost_cap, limits, "bounded", k)
            found.append(run.run())
            if not run.capped:
                break  # keeping more states would not change a thing
    plans = [f for f in found if f is not None]
    if not plans:
        return None
    best = min(plans, key=lambda f: (f.peak, f.cost) if by_peak else (f.cost, f.peak))
    return dataclasses.replace(best, work=sum(f.work for f in plans))


def lower_bound(ix: Index, space: Space, budget: float, *, by_peak: bool = False,
                cost_cap: float = math.inf, limits: Limits = LIMITS) -> Optional[float]:
    """A lower bound on the objective (cost, or peak ``by_peak``) of every plan of ``space``
    whose peak fits ``budget``; ``None`` when no plan of the space fits it, or (``cost_cap``,
    the cost of a plan in hand) none costs less than ``cost_cap``. Peaks count the reserve, as
    in :func:`search`."""
    budget -= ix.reserve
    if ix.n == 0:
        return 0.0 if budget >= 0 else None
    # Dropped entries lower the bound (relax): fronts four times finer than the fast search's.
    fine = dataclasses.replace(space, ratio=min(space.ratio, 0.01),
                               front_size=max(space.front_size, 64))
    with _no_gc():
        found = _Search(ix, fine, budget, by_peak, cost_cap, limits, "relaxed",
                        limits.relaxed_kept).run()
    if found is None:
        return None
    return float(found.peak + ix.reserve) if by_peak else found.cost


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    # The search allocates millions of small acyclic tuples; the cyclic collector would rescan
    # every live one again and again (superlinear on big graphs), and there is nothing to collect.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

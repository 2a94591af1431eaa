"""Bounded work for the search: when to stop being exact, and what the heuristic keeps.

The DP state of :mod:`fxckpt.solver.search` is a cut plus the set ``A`` of crossing values
already held for backward. Where many values stay live across cuts (an unrolled RNN whose hidden
states all feed one ``cat``, a DenseNet block, an MLP that mixes every hidden state at the end),
each of them is held or not depending on the plan, and the number of distinct ``A`` doubles with
every one: 27,000 states at one cut for a 16-step LSTM, a ``MemoryError`` at 24 steps. So a
search runs in up to three passes:

1. the *exact pass* (the search as it always was) gives up as soon as one cut has more than
   :attr:`Limits.states` states or its work passes :attr:`Limits.work`; graphs that stay under
   both get exactly the plans they got before;
2. the *bounded pass* spreads :attr:`Limits.bounded_work` over the cuts. At a cut whose states
   would cost more than its share, they are merged into at most ``K`` states, kept far apart
   (:func:`_reps`), and each front is cut to at most :attr:`Limits.front` entries
   (:func:`limit`). It runs for each ``K`` of :attr:`Limits.kept`, and the best plan wins;
3. the *relaxed pass* (:func:`~fxckpt.solver.search.lower_bound`) does the same with merges in
   the other direction, and bounds what any plan of the space could save.

Merging is sound in both directions, which is what makes the heuristic's distance measurable:

* *pessimistic* (the plan search): a state ``(A, hout)`` folded into a kept ``(A', hout')`` adds
  ``bytes(A' - A) + max(0, hout' - hout)`` to its entries' ``H``. Every peak term then counts at
  least what the plan holds (values of ``A - A'`` held again later are counted twice, and counted
  as dead from the merge on), so a plan that fits by this accounting fits the simulator too;
* *optimistic* (the bound): states are folded into the union of their ``A`` and the largest
  ``hout``, with ``H`` unchanged, and dropped front entries are merged into the kept entry below
  them as ``(its H, the least objective)``. Every term then counts at most what the plan holds,
  so the least objective this *relaxed* search finds is a lower bound for every plan of the
  space. Unions lose little where the values differ late (LSTMs: within 0.1-2.5% of the plan);
  on a long synthetic cell (:func:`benchmarks.solver_graphs.unrolled_cell`, 250 steps and
  more) the bound falls to 0 and says nothing.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from typing import Sequence

from fxckpt.solver.problem import Index

__all__ = [
    "Limits", "LIMITS", "GaveUp", "State", "limit", "relax", "cap", "pareto_front",
]

Entry = tuple
"""(H, objective, tie-break, parent entry, (block start, block end, is segment))."""

_ORDER = operator.itemgetter(0, 1, 2)
"""Entries by H, then objective, then tie-break."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """How much one search may do before it turns heuristic, and what the heuristic may do."""

    states: int = 256
    """The exact pass gives up when one cut has more states than this. Transformer, ResNet and
    MLP problems have at most 8; a 12-step unrolled LSTM reaches 1,800."""
    work: int = 4_000_000
    """... or when its work passes this, or runs ahead of a linear share of it by an eighth of
    it. Work counts each entry extended and :data:`~fxckpt.solver.search.STEP` for each state
    made and each state and move tried: the full search of the benchmark's 12-layer Llama (653
    ops) does up to 3.2 million, in 2-4 s on the benchmark machine."""
    bounded_work: int = 1_000_000
    """What the bounded pass spreads over the cuts left (about a second)."""
    front: int = 32
    """At most this many entries per state where the bounded pass has to cut."""
    floor: int = 2
    """... and never fewer (the least ``H`` and the least objective)."""
    kept: tuple[int, ...] = (1, 2, 4)
    """The bounded pass runs once for each of these numbers of states kept at a cut where it
    merges, each with :attr:`bounded_work`, and the cheapest plan wins (a pass that never had
    to keep fewer than it could ends the series; the smallest-peak search runs the middle one
    only). No one number was best: on
    unrolled LSTMs (16-32 steps), a stacked GRU, a DenseNet-style block and an MLP mixing its
    hidden states, at budgets 0.5-0.9, each of 1, 2 and 4 missed the best plan found by up to
    16% somewhere while another found it; more states with shorter fronts did worse."""
    relaxed_kept: int = 2
    """States kept by the relaxed pass (the bound) where it merges."""


LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class GaveUp:
    """Where the exact pass stopped."""

    work: int
    """Entries it had extended (plus one per state and move)."""
    states: int
    """States at the cut where it stopped."""


@dataclasses.dataclass
class State:
    """One DP state at a cut: held crossing values and the entries that reached it."""

    held: frozenset[int]
    hout: int
    closed_offset: int
    """hout + bytes of held non-output crossing values: closed(p) = H - closed_offset."""
    entries: list[Entry]
    by_use: tuple[int, ...] = ()
    """``held`` by last use: the values still crossing a later cut ``q`` are a suffix."""
    uses: list[int] = dataclasses.field(default_factory=list)
    dead: list[int] = dataclasses.field(default_factory=list)
    """``dead[i]``: bytes of the non-output values among ``by_use[:i]``."""
    suffixes: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)

    def index(self, ix: Index) -> None:
        """Sort ``held`` by last use (once the state is known to be kept)."""
        self.by_use = tuple(sorted(self.held, key=ix.last_use.__getitem__))
        self.uses = [ix.last_use[j] for j in self.by_use]
        run, self.dead = 0, [0]
        for j in self.by_use:
            run += 0 if ix.is_output[j] else ix.out[j]
            self.dead.append(run)

    def crossing(self, q: int) -> tuple[frozenset[int], int]:
        """Held values still read at or after ``q``, and the bytes of those non-output ones."""
        i = bisect.bisect_left(self.uses, q)
        live = self.closed_offset - self.hout - self.dead[i]
        if i == 0:
            return self.held, live
        got = self.suffixes.get(i)
        if got is None:
            got = self.suffixes[i] = frozenset(self.by_use[i:])
        return got, live


def _bytes(ix: Index, values: frozenset[int]) -> int:
    return sum(map(ix.out.__getitem__, values))


def _distance(ix: Index, a: State, b: State) -> int:
    """Bytes by which two states' accounting differs: values one holds and the other does not,
    and their held output bytes."""
    return _bytes(ix, a.held ^ b.held) + abs(a.hout - b.hout)


def _reps(ix: Index, states: Sequence[State], k: int) -> list[int]:
    """Up to ``k`` states to keep, far apart: the state with the least ``H`` (then the least
    objective), then each time the state farthest from those kept (:func:`_distance`; then the
    least ``H``), so that every state is folded into one that holds much the same."""
    hs = [st.entries[0][0] for st in states]
    objs = [min(e[1] for e in st.entries) for st in states]
    least = min(range(len(states)), key=lambda i: (hs[i], objs[i], i))
    chosen = [least]
    near = [_distance(ix, st, states[least]) for st in states]
    while len(chosen) < k:
        far = max(range(len(states)), key=lambda i: (near[i], -hs[i], -i))
        if near[far] == 0:
            break
        chosen.append(far)
        near = [min(d, _distance(ix, st, states[far])) for d, st in zip(near, states)]
    return chosen


def _merge(ix: Index, states: list[State], k: int, optimistic: bool) -> list[State]:
    """At most ``k`` states holding every entry (see the module notes for both directions)."""
    reps = _reps(ix, states, k)
    groups: dict[int, list[State]] = {r: [] for r in reps}
    for i, st in enumerate(states):
        if i not in groups:  # to the kept state it differs least from
            groups[min(reps, key=lambda r: (_distance(ix, st, states[r]), r))].append(st)
    merged = []
    for r, members in groups.items():
        rep = states[r]
        if optimistic:  # the union: later holds of what one member held are free to all
            held = rep.held.union(*(m.held for m in members))
            hout = max([rep.hout] + [m.hout for m in members])
            entries = [e for m in (rep, *members) for e in m.entries]
            offset = hout + sum(ix.out[j] for j in held if not ix.is_output[j])
        else:  # the rep: members count what it holds besides, as if they held it too
            held, hout, offset = rep.held, rep.hout, rep.closed_offset
            entries = list(rep.entries)
            for m in members:
                d = _bytes(ix, held - m.held) + max(0, hout - m.hout)
                entries += [(e[0] + d, *e[1:]) for e in m.entries]
        merged.append(State(held, hout, offset, entries))
    return merged


def cap(front: list[Entry], size: int, optimistic: bool) -> list[Entry]:
    """At most ``size`` entries of a Pareto front (sorted by H, objective falling): the first
    and the last and ones spread between; optimistically, each dropped entry's objective and
    tie-break lower the kept entry before it."""
    if len(front) <= size:
        return front
    size = max(2, size)
    picks = sorted({round(i * (len(front) - 1) / (size - 1)) for i in range(size)})
    if not optimistic:
        return [front[i] for i in picks]
    out: list[Entry] = []
    for a, b in zip(picks, picks[1:] + [len(front)]):
        bucket = front[a:b]
        out.append((bucket[0][0], min(e[1] for e in bucket), min(e[2] for e in bucket),
                    None, bucket[0][4]))
    return out


def relax(front: list[Entry], kept: list[Entry]) -> list[Entry]:
    """``kept`` (a thinning of ``front``) with every dropped entry merged optimistically into
    the kept entry before it."""
    keep = {id(e) for e in kept}
    out: list[Entry] = []
    for e in front:
        if id(e) in keep or not out:
            out.append(e)
        else:
            h, obj, tie, _, move = out[-1]
            out[-1] = (h, min(obj, e[1]), min(tie, e[2]), None, move)
    return out


def limit(ix: Index, states: list[State], moves: int, share: int, limits: Limits,
          kept: int, optimistic: bool) -> tuple[list[State], int, bool]:
    """``states`` cut down so that extending them by ``moves`` moves costs about ``share``
    (at most ``kept`` states); the merge's work, in comparisons of a state with a kept state;
    and whether ``kept`` was what bound the number of states (a larger one would differ)."""
    cost = sum(len(st.entries) + 1 for st in states) * moves
    if cost <= share:
        return states, 0, False
    front = limits.front
    affordable = min(len(states), share // ((front + 1) * moves))
    k = max(1, min(affordable, kept))
    if k == 1:
        front = max(limits.floor, min(front, share // moves - 1))
    work = 0
    if k < len(states):
        work = len(states) * k
        states = _merge(ix, states, k, optimistic)
        for st in states:
            st.entries = pareto_front(st.entries)
    for st in states:
        st.entries = cap(st.entries, front, optimistic)
    return states, work, affordable > kept


def pareto_front(entries: list[Entry]) -> list[Entry]:
    """Non-dominated entries: sorted by H, objective strictly falling."""
    entries.sort(key=_ORDER)
    front: list[Entry] = []
    best = math.inf
    for e in entries:
        if e[1] < best:
            front.append(e)
            best = e[1]
    return front

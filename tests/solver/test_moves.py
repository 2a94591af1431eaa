"""solver.moves: which blocks the search may place (cut positions, segment ends) and caching.

``views`` has a run of two null ops (views: no bytes, no cost, nothing saved)::

    0 a = mm(x)   1 b = relu(a)   2 v1 = view(a)   3 v2 = view(v1)   4 c = mm(v2, b)   5 d = mm(c)
"""

from __future__ import annotations

from .solver_oracle import random_dag

from fxckpt.solver import Op, Problem
from fxckpt.solver.moves import Space, moves, profiles
from fxckpt.solver.tables import Profiles, SegmentWalker


def views() -> Problem:
    return Problem(ops=(
        Op(name="a", out_bytes=100, cost=1.0, inputs=("x",), saves=("x",)),
        Op(name="b", out_bytes=100, cost=1.0, inputs=("a",), saves=("b",)),
        Op(name="v1", out_bytes=0, cost=0.0, inputs=("a",)),
        Op(name="v2", out_bytes=0, cost=0.0, inputs=("v1",)),
        Op(name="c", out_bytes=100, cost=1.0, inputs=("v2", "b"), saves=("b",)),
        Op(name="d", out_bytes=100, cost=1.0, inputs=("c",), saves=("c",)),
    ), outputs=("d",))


def test_space_defaults() -> None:
    s = Space(exact=False)
    assert (s.short, s.spacing, s.reach, s.hull, s.ratio, s.grain, s.front_size) \
        == (10, 8, 24, True, 0.05, 0.0, 32)


def test_exact_space_every_cut_and_every_end() -> None:
    ix = views().index
    m = moves(ix, Space(exact=True))
    assert m.positions == [0, 1, 2, 3, 4, 5]
    assert m.group_end == {p: p + 1 for p in range(6)}
    assert [(f.start, f.end) for f in m.candidates(3)] == [(3, 4), (3, 5), (3, 6)]
    assert [f.end for f in m.candidates(0)] == [1, 2, 3, 4, 5, 6]


def test_fast_space_groups_null_runs_and_never_starts_a_segment_with_one() -> None:
    ix = views().index
    m = moves(ix, Space(exact=False))
    assert m.positions == [0, 1, 2, 4, 5]  # v2 is part of the group starting at v1
    assert m.group_end == {0: 1, 1: 2, 2: 4, 4: 5, 5: 6}
    assert m.ends[2] == () and list(m.candidates(2)) == []
    # A segment from a may not stop before the views: they read only a, inside the segment.
    # One from b may: the views read a, from before b, which the segment would then keep.
    assert m.ends[0] == (1, 4, 5, 6)
    assert m.ends[1] == (2, 4, 5, 6)
    assert m.ends[4] == (5, 6) and m.ends[5] == (6,)


def test_short_segments_then_anchors() -> None:
    ix = views().index
    m = moves(ix, Space(exact=False, short=1, spacing=1, reach=1))
    # crossing = (0, 100, 200, 100, 100, 100, 0): anchors at the allowed cuts 1, 4, 5 (and ends)
    assert profiles(ix).crossing == (0, 100, 200, 100, 100, 100, 0)
    # one real op (plus the null run after it), then the next `reach` anchor after that
    assert m.ends[0] == (1, 4)
    assert m.ends[1] == (2, 4, 5)
    assert m.ends[4] == (5, 6)


def test_moves_and_profiles_are_cached_per_problem_and_space() -> None:
    ix = views().index
    assert profiles(ix) is profiles(ix) and profiles(ix) == Profiles.build(ix)
    fast = moves(ix, Space(exact=False))
    # Front thinning does not change the moves: one table serves every thinning.
    assert moves(ix, Space(exact=False, hull=False, ratio=0.5, grain=0.1, front_size=3)) is fast
    assert moves(ix, Space(exact=False, short=2)) is not fast
    assert moves(ix, Space(exact=True)) is moves(ix, Space(exact=True, ratio=0.9))


def test_segment_facts_are_walked_once_and_match_a_fresh_walk() -> None:
    problem = random_dag(12, 5)
    ix = problem.index
    m = moves(ix, Space(exact=True))
    prof = profiles(ix)
    for p, q in [(2, 9), (2, 5), (2, 12), (0, 1), (7, 8)]:  # (2, 5) after (2, 9): a new walker
        walker = SegmentWalker(ix, prof, p)
        for _ in range(q - p):
            walker.advance()
        assert m.get(p, q) == walker.facts()
        assert m.get(p, q) is m.get(p, q)
    assert set(m.facts) >= {(2, 9), (2, 5), (2, 12), (0, 1), (7, 8)}


def test_one_op_problem() -> None:
    ix = Problem(ops=(Op(name="a", out_bytes=8, cost=1.0, inputs=("x",)),),
                 outputs=("a",)).index
    for exact in (True, False):
        m = moves(ix, Space(exact=exact))
        assert m.positions == [0] and m.group_end == {0: 1}
        assert [(f.start, f.end, f.keeps) for f in m.candidates(0)] == [(0, 1, ())]

"""solver.tables: profiles, segment facts and anchors, by hand and against their definitions.

``chain4`` (the simulator tests' chain): a = mm(x) 100 B, b = relu(a) 100 B, c = mm(b) 50 B,
d = sum(c) 10 B, output d; gradients default to the output size.
"""

from __future__ import annotations

import pytest
from .solver_oracle import chain4, random_dag, transformer_like

from fxckpt.solver import Op, Problem, simulate
from fxckpt.solver.problem import Index
from fxckpt.solver.tables import (
    Profiles,
    SegmentWalker,
    anchors,
    local_peak,
    recompute_phase,
)


def test_profiles_of_chain4_by_hand() -> None:
    prof = Profiles.build(chain4().index)
    assert prof.trans == (100, 200, 150, 60)  # each value from its op to its last reader
    assert prof.grad_live == (100, 200, 150, 60)  # e.g. backward c: grad c 50 + grad b 100
    assert prof.grad_gap == (0, 100, 100, 50, 10)  # recompute before op e-1's backward
    assert prof.crossing == (0, 100, 100, 50, 0)
    assert prof.ended_at == ((), (0,), (1,), (2,))
    assert prof.first_saved_by == ((), (1,), (), ())  # b is saved first by itself
    assert prof.backward_start == 10 + 10  # output d and its gradient


def test_walker_facts_of_chain4_by_hand() -> None:
    ix = chain4().index
    walker = SegmentWalker(ix, Profiles.build(ix), 1)
    walker.advance()
    f = walker.facts()
    assert (f.start, f.end, f.cost, f.keeps, f.forward, f.backward_lb, f.local) \
        == (1, 2, 1.0, (0,), 200, 300, -1)
    walker.advance()
    f = walker.facts()
    # forward c: trans 150 + a (kept for the segment, its last reader b already ran) = 250
    assert (f.end, f.cost, f.keeps, f.forward, f.backward_lb) == (3, 5.0, (0,), 250, 300)


def test_recompute_phase_and_local_peak_of_chain4() -> None:
    ix = chain4().index
    prof = Profiles.build(ix)
    assert recompute_phase(ix, 1, 3) == 150  # b' (saved by c) then c' while b' is alive
    assert recompute_phase(ix, 1, 2) == 100
    assert recompute_phase(ix, 0, 4) == 200  # recompute b: a' (read at this step) and b'
    walker = SegmentWalker(ix, prof, 1)
    walker.advance()
    walker.advance()
    f = walker.facts()
    # max(recompute 150 + gradients alive then (grad c 50), backward bound 300)
    assert local_peak(ix, prof, f) == 300 and f.local == 300


def test_anchors_of_chain4() -> None:
    ix = chain4().index
    prof = Profiles.build(ix)
    assert anchors(ix, prof, 1, 8) == (0, 3, 4)  # only 3 is within 25% of the cheapest cut
    assert anchors(ix, prof, 1, 8, allowed={1, 2}) == (0, 4)


def test_anchors_keep_their_spacing() -> None:
    problem = transformer_like(2, extra_views=0)
    ix = problem.index
    prof = Profiles.build(ix)
    for spacing in (2, 4, 8):
        marks = anchors(ix, prof, spacing, 4 * spacing)
        inner = marks[1:-1]
        assert marks[0] == 0 and marks[-1] == ix.n and inner
        assert all(b - a >= spacing for a, b in zip(inner, inner[1:]))
        for p in inner:  # cheap: within 25% of the cheapest cut nearby
            near = prof.crossing[max(1, p - 4 * spacing): min(ix.n - 1, p + 4 * spacing) + 1]
            assert prof.crossing[p] * 4 <= 5 * min(near)


PROBLEMS = [random_dag(n, seed) for n, seed in ((6, 0), (9, 1), (12, 2), (15, 3))]


def _grad_window(ix: Index, j: int) -> tuple[int, int]:
    """Backward positions during which the gradient of op ``j`` is alive (``j .. grad_from``)."""
    return j, min(ix.grad_from[j], ix.n - 1)


@pytest.mark.parametrize("problem", PROBLEMS, ids=[f"dag{len(p.ops)}" for p in PROBLEMS])
def test_profiles_match_their_definitions(problem: Problem) -> None:
    ix = problem.index
    prof = Profiles.build(ix)
    n = ix.n
    assert prof.trans == tuple(sum(ix.out[j] for j in range(n) if j <= t <= ix.last_alive[j])
                               for t in range(n))
    assert prof.crossing == tuple(sum(ix.out[j] for j in range(n) if j < p <= ix.last_use[j])
                                  for p in range(n + 1))
    assert prof.grad_live == tuple(
        sum(ix.grad[j] for j in range(n) if _grad_window(ix, j)[0] <= i <= _grad_window(ix, j)[1])
        for i in range(n))
    assert prof.grad_gap == (0,) + tuple(
        sum(ix.grad[j] for j in range(n) if j < e <= ix.grad_from[j]) for e in range(1, n + 1))
    assert prof.backward_start == sum(ix.out[j] + ix.grad[j] for j in range(n) if ix.is_output[j])


@pytest.mark.parametrize("problem", PROBLEMS, ids=[f"dag{len(p.ops)}" for p in PROBLEMS])
def test_walker_matches_definitions_at_every_end(problem: Problem) -> None:
    ix = problem.index
    prof = Profiles.build(ix)
    n = ix.n
    for p in range(n):
        walker = SegmentWalker(ix, prof, p)
        for q in range(p + 1, n + 1):
            walker.advance()
            f = walker.facts()
            keeps = list(dict.fromkeys(j for k in range(p, q) for j in ix.touches[k] if j < p))
            dead = [sum(ix.out[j] for j in keeps if not ix.is_output[j] and ix.last_use[j] < t)
                    for t in range(p, q)]
            forward = max(prof.trans[t] + dead[t - p] for t in range(p, q))
            backward = max(sum(ix.out[j] for j in range(p, n) if p <= ix.first_saver[j] <= i)
                           + prof.grad_live[i] for i in range(p, q))
            assert (f.end, f.keeps, f.forward, f.backward_lb) == (q, tuple(keeps), forward,
                                                                  backward)
            assert f.cost == pytest.approx(ix.cum_cost[q] - ix.cum_cost[p])


def test_trans_and_grad_live_are_the_simulated_step_when_nothing_is_saved() -> None:
    """With no saved tensors nothing is held for backward: the simulator's forward steps are
    ``trans`` and its backward steps (after backward start) are ``grad_live``."""
    ops = [Op(name="a", out_bytes=30, cost=1.0, inputs=("x",)),
           Op(name="b", out_bytes=50, cost=1.0, inputs=("a",)),
           Op(name="c", out_bytes=20, cost=1.0, inputs=("a", "b")),
           Op(name="d", out_bytes=70, cost=1.0, inputs=("b",), grad_bytes=5),
           Op(name="e", out_bytes=10, cost=1.0, inputs=("c", "d"))]
    problem = Problem(ops=tuple(ops), outputs=("e", "c"))
    prof = Profiles.build(problem.index)
    live = [v for _, v in simulate(problem).timeline]
    assert tuple(live[:5]) == prof.trans
    assert tuple(reversed(live[6:])) == prof.grad_live
    assert live[5] == prof.backward_start == 10 + 10 + 20 + 20  # outputs e, c and grads


def test_zero_size_problem_has_empty_profiles() -> None:
    ops = tuple(Op(name=f"v{i}", out_bytes=0, cost=0.0, inputs=(f"v{i - 1}",) if i else ())
                for i in range(3))
    ix = Problem(ops=ops, outputs=("v2",)).index
    prof = Profiles.build(ix)
    assert prof.trans == prof.grad_live == (0, 0, 0)
    assert prof.crossing == prof.grad_gap == (0, 0, 0, 0)
    assert prof.backward_start == 0 and recompute_phase(ix, 0, 3) == 0

"""The memory simulator against peaks computed by hand, and its input checks.

Every expected timeline below was worked out on paper from the rules in
``fxckpt/solver/simulate.py``; the comments give the live tensors at each step.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from .solver_oracle import chain4

from fxckpt.solver import (
    BudgetInfeasible, Op, Problem, check_segments, held_at_backward, peak_bytes, simulate,
)


def relu_chain() -> Problem:
    """Four relus, each saving its own output; small gradients (10 bytes)."""
    return Problem(ops=tuple(
        Op(name=f"r{i}", out_bytes=100, cost=1.0, inputs=(f"r{i - 1}" if i else "x",),
           saves=(f"r{i}",), grad_bytes=10) for i in range(4)), outputs=("r3",))


def residual() -> Problem:
    """e -> norm -> mm -> relu -> mm -> add(., e): a pre-norm residual block (no gradients)."""
    return Problem(ops=(
        Op(name="e", out_bytes=100, cost=1.0, inputs=("tokens",), grad_bytes=0),
        Op(name="n", out_bytes=100, cost=1.0, inputs=("e",), saves=("e",), grad_bytes=0),
        Op(name="h", out_bytes=400, cost=8.0, inputs=("n",), saves=("n",), grad_bytes=0),
        Op(name="g", out_bytes=400, cost=1.0, inputs=("h",), saves=("g",), grad_bytes=0),
        Op(name="o", out_bytes=100, cost=8.0, inputs=("g",), saves=("g",), grad_bytes=0),
        Op(name="y", out_bytes=100, cost=1.0, inputs=("o", "e"), grad_bytes=0),
    ), outputs=("y",))


def unet() -> Problem:
    """conv -> pool -> conv -> up -> cat(up, first conv) -> conv: a one-level U-Net skip."""
    return Problem(ops=(
        Op(name="d1", out_bytes=100, cost=4.0, inputs=("x",), saves=("x",), grad_bytes=0),
        Op(name="p", out_bytes=50, cost=1.0, inputs=("d1",), saves=("d1",), grad_bytes=0),
        Op(name="m", out_bytes=50, cost=4.0, inputs=("p",), saves=("p",), grad_bytes=0),
        Op(name="u", out_bytes=100, cost=1.0, inputs=("m",), grad_bytes=0),
        Op(name="c", out_bytes=200, cost=1.0, inputs=("u", "d1"), grad_bytes=0),
        Op(name="f", out_bytes=100, cost=4.0, inputs=("c",), saves=("c",), grad_bytes=0),
    ), outputs=("f",))


def test_chain_without_segments() -> None:
    sim = simulate(chain4(), [])
    assert sim.timeline == (
        ("forward a", 100),        # a
        ("forward b", 200),        # a b
        ("forward c", 150),        # b c             (a's last reader ran; nobody saved it)
        ("forward d", 160),        # b c d
        ("backward start", 120),   # b d  grad(d)=10
        ("backward d", 160),       # b  grad d, grad c=50
        ("backward c", 250),       # b  grad c, grad b=100
        ("backward b", 300),       # b  grad b, grad a=100
        ("backward a", 100),       # grad a
    )
    assert (sim.peak_bytes, sim.forward_peak, sim.recompute_cost) == (300, 200, 0.0)


def test_chain_with_segment_keeps_its_input_and_recomputes() -> None:
    sim = simulate(chain4(), [(1, 3)])
    assert sim.timeline == (
        ("forward a", 100),        # a (kept: input of the segment)
        ("forward b", 200),        # a b
        ("forward c", 250),        # a b c
        ("forward d", 160),        # a c d
        ("backward start", 120),   # a d  grad d
        ("backward d", 160),       # a  grad d, grad c
        ("recompute b", 250),      # a b'  grad c
        ("recompute c", 300),      # a b' c'  grad c  (c' dies at once: nobody in [b, c] needs it)
        ("backward c", 350),       # a b'  grad c, grad b
        ("backward b", 400),       # a b'  grad b, grad a
        ("backward a", 100),       # grad a
    )
    assert (sim.peak_bytes, sim.forward_peak, sim.recompute_cost) == (400, 250, 5.0)


def test_relu_chain_checkpoint_lowers_the_peak() -> None:
    plain = simulate(relu_chain())
    assert plain.peak_bytes == 420  # backward r3: r0..r3 + grad r3 + grad r2
    sim = simulate(relu_chain(), [(0, 3)])
    assert [live for _, live in sim.timeline] == [
        100, 200, 200, 200,        # forward: r0 | r0 r1 | r1 r2 | r2 r3
        110,                       # backward start: r3 + grad r3
        120,                       # backward r3: r3 + grad r3 + grad r2
        110, 210, 310,             # recompute r0, r1, r2 (each saved) + grad r2
        320, 220, 110,             # backward r2, r1, r0
    ]
    assert (sim.peak_bytes, sim.forward_peak, sim.recompute_cost) == (320, 200, 3.0)


def test_residual_block() -> None:
    plain = simulate(residual())
    # forward: e | e n | e n h | e n h g | e n g o | e n g o y; start: e n g y; backward frees.
    assert [live for _, live in plain.timeline] == [
        100, 200, 600, 1000, 700, 800, 700, 600, 600, 600, 200, 100, 0]
    sim = simulate(residual(), [(1, 5)])
    assert [live for _, live in sim.timeline] == [
        100, 200, 600, 900, 600, 300,  # forward: e kept for the segment; n, h, g die early
        200,                           # backward start: e y
        100,                           # backward y: e
        200, 600, 1000, 700,           # recompute n h g o (h dies after g; o after itself)
        600, 600, 200, 100,            # backward o g h n: n' until h, g' until g, e until n
        0,                             # backward e
    ]
    assert sim.peak_bytes == 1000 and sim.forward_peak == 900 and sim.recompute_cost == 18.0


def test_unet_skip_stays_alive_across_the_segment() -> None:
    plain = simulate(unet())
    assert [live for _, live in plain.timeline] == [
        100, 150, 200, 300, 450, 450, 450, 350, 150, 150, 150, 100, 0]
    sim = simulate(unet(), [(1, 4)])
    assert [live for _, live in sim.timeline] == [
        100, 150, 200, 250, 400, 400,  # forward: d1 kept by the segment and read by cat
        400,                           # backward start: d1 c f
        300, 100,                      # backward f, c
        150, 200, 300,                 # recompute p m u
        150, 150, 100, 0,              # backward u m p d1
    ]
    assert (sim.peak_bytes, sim.forward_peak) == (400, 400)
    assert peak_bytes(unet(), [(1, 4)]) == 400


def test_timeline_event_order() -> None:
    events = [event for event, _ in simulate(chain4(), [(0, 2)]).timeline]
    assert events[4:] == ["backward start", "backward d", "backward c",
                          "recompute a", "recompute b", "backward b", "backward a"]


def test_views_and_unknown_names_cost_nothing() -> None:
    problem = Problem(ops=(
        Op(name="a", out_bytes=64, cost=1.0, inputs=("x", "weight"), saves=("x", "weight")),
        Op(name="v", out_bytes=0, cost=0.0, inputs=("a",)),
        Op(name="s", out_bytes=8, cost=1.0, inputs=("v",)),
    ), outputs=("s",))
    assert problem.graph_inputs == ("x", "weight")
    # a | a v (0 bytes) | s (a's last reader was v) | start: s, grad s | backward s: grad s,
    # grad v (0) | backward v: grad a | backward a: grad a. Graph inputs never count.
    assert [live for _, live in simulate(problem).timeline] == [64, 64, 8, 16, 8, 64, 64]


@pytest.mark.parametrize("segments, message", [
    ([(2, 1)], "0 <= start < end <= 4"),
    ([(0, 5)], "0 <= start < end <= 4"),
    ([(0, 2), (1, 3)], "overlap"),
    ([(0,)], "(start, end) pairs"),
    (5, "(start, end) pairs"),
])
def test_bad_segments(segments: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(chain4(), segments)


def test_segments_are_sorted() -> None:
    assert check_segments([(2, 3), (0, 1)], 4) == ((0, 1), (2, 3))


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="", out_bytes=1, cost=1.0), "non-empty string"),
    (dict(name="a", out_bytes=-1, cost=1.0), "out_bytes must be a non-negative int"),
    (dict(name="a", out_bytes=1.5, cost=1.0), "out_bytes must be a non-negative int"),
    (dict(name="a", out_bytes=1, cost=float("nan")), "cost must be a finite number"),
    (dict(name="a", out_bytes=1, cost=-2), "cost must be a finite number"),
    (dict(name="a", out_bytes=1, cost=1, grad_bytes=-3), "grad_bytes"),
    (dict(name="a", out_bytes=1, cost=1, inputs="x"), "tuple of op names"),
])
def test_bad_op(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Op(**kwargs)


def test_bad_problem() -> None:
    a = Op(name="a", out_bytes=1, cost=1.0, inputs=("b",))
    b = Op(name="b", out_bytes=1, cost=1.0)
    with pytest.raises(ValueError, match="topological order"):
        Problem(ops=(a, b), outputs=("a",))
    with pytest.raises(ValueError, match="saves the later op"):
        Problem(ops=(Op(name="a", out_bytes=1, cost=1.0, saves=("b",)), b), outputs=("b",))
    with pytest.raises(ValueError, match="unique"):
        Problem(ops=(b, b), outputs=("b",))
    with pytest.raises(ValueError, match="not an op"):
        Problem(ops=(b,), outputs=("zz",))


def test_lists_are_accepted_and_frozen() -> None:
    op = Op(name="a", out_bytes=1, cost=1.0, inputs=["x"], saves=["x"])  # type: ignore[arg-type]
    assert op.inputs == ("x",) and op.saves == ("x",)
    problem = Problem(ops=[op], outputs=["a"])  # type: ignore[arg-type]
    assert problem.ops == (op,)


def test_held_at_backward_is_what_backward_start_holds_op_by_op() -> None:
    # chain4 without checkpointing holds b (saved by c) and the output d; with segment [b, c]
    # it holds a (the segment's input) instead of b.
    assert held_at_backward(chain4()) == (0, 100, 0, 10)
    assert held_at_backward(chain4(), [(1, 3)]) == (100, 0, 0, 10)
    for problem, segments in ((chain4(), [(1, 3)]), (relu_chain(), [(0, 3)]),
                              (residual(), [(1, 5)])):
        start = {p: dict(simulate(problem, p).timeline)["backward start"]
                 for p in ((), tuple(segments))}
        drop = sum(held_at_backward(problem)) - sum(held_at_backward(problem, segments))
        assert drop == start[()] - start[tuple(segments)]  # gradients at the start are the same


def test_every_peak_counts_the_problems_reserve_and_the_solver_meets_budgets_with_it() -> None:
    """The reserve is part of the problem: simulate's peaks include it, the solvers' budgets
    count it, and nothing outside adds or subtracts it."""
    from fxckpt.solver import min_feasible_peak, solve
    from fxckpt.solver.search import lower_bound, search
    from fxckpt.solver.moves import Space

    ops = tuple(Op(name=f"o{i}", out_bytes=100, cost=10, inputs=(f"o{i - 1}",) if i else ("x",),
                   saves=(f"o{i - 1}",) if i else ("x",)) for i in range(6))
    bare = Problem(ops=ops, outputs=("o5",))
    held = dataclasses.replace(bare, reserve_bytes=1000)
    assert held.index.reserve == 1000
    for segs in ((), ((1, 4),), ((0, 3), (3, 5))):
        a, b = simulate(bare, segs), simulate(held, segs)
        assert b.peak_bytes == a.peak_bytes + 1000 and b.forward_peak == a.forward_peak + 1000
        assert b.timeline == a.timeline and b.reserve_bytes == 1000
        assert peak_bytes(held, segs) == b.peak_bytes
    assert min_feasible_peak(held) == min_feasible_peak(bare) + 1000
    budget = min_feasible_peak(bare) + 100
    plan = solve(bare, budget)
    moved = solve(held, budget + 1000)
    assert (moved.segments, moved.predicted_peak) == (plan.segments, plan.predicted_peak + 1000)
    with pytest.raises(BudgetInfeasible) as e:
        solve(held, budget)  # the bare problem's budget leaves no room for the reserve
    assert e.value.min_budget == min_feasible_peak(held)
    found = search(held.index, Space(exact=True), budget + 1000)
    assert found is not None and found.peak == peak_bytes(held, found.segments)
    assert lower_bound(held.index, Space(exact=True), math.inf, by_peak=True) \
        == min_feasible_peak(held)
    with pytest.raises(ValueError, match="reserve_bytes"):
        Problem(ops=ops, outputs=("o5",), reserve_bytes=-1)

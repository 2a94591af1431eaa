"""cost/prediction.py: every plan's predicted peak, recompute share and freed bytes, alike.

A chain ``x -> a -> b -> c -> d -> loss`` of 100-byte outputs, each op saving its input for
backward and costing 10; ``b``'s kernel needs 500 bytes of scratch, which the problem's reserve
covers (the bridge from the graph sets it so: tests/cost/test_bridge.py).
"""

from __future__ import annotations

from fxckpt.cost.prediction import predict_spans, recompute_share
from fxckpt.solver import Op, Problem, simulate


def _chain(scratch: int = 500) -> Problem:
    ops = (Op(name="a", out_bytes=100, cost=10, inputs=("x",), saves=("x",)),
           Op(name="b", out_bytes=100, cost=10, inputs=("a",), saves=("a",),
              scratch_bytes=scratch),
           Op(name="c", out_bytes=100, cost=10, inputs=("b",), saves=("b",)),
           Op(name="d", out_bytes=100, cost=10, inputs=("c",), saves=("c",)),
           Op(name="loss", out_bytes=4, cost=0, inputs=("d",), saves=("d",), grad_bytes=0))
    return Problem(ops=ops, outputs=("loss",), reserve_bytes=scratch)


def test_no_segments_predicts_the_eager_step_its_reserve_included() -> None:
    problem = _chain()
    p = predict_spans(problem, ())
    sim = simulate(problem, ())
    assert p.peak == p.eager_peak == sim.peak_bytes == max(b for _, b in sim.timeline) + 500
    assert (p.recompute, p.share, p.frees) == (0, 0.0, ())


def test_a_segment_frees_its_inner_outputs_and_recomputes_its_share() -> None:
    problem = _chain()
    p = predict_spans(problem, ((1, 3),))  # b and c run again in backward
    # b's output is read only inside the segment: freed from forward to backward; c's is saved
    # by d, outside, and stays
    assert p.frees == (100,)
    assert p.share == 20 / 40  # two of the four costed ops: half a forward pass
    assert p.recompute == 20
    sim = simulate(problem, ((1, 3),))
    assert p.peak == sim.peak_bytes == max(b for _, b in sim.timeline) + 500
    assert p.peak <= p.eager_peak


def test_a_kept_op_is_not_recomputed() -> None:
    problem = _chain()
    assert recompute_share(problem, ((1, 3),), keep=(1,)) == 10 / 40
    assert recompute_share(problem, ((0, 4),)) == 1.0

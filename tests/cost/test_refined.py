"""Refined prices: one measured factor on every op's price, the overheads left as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxckpt.capture.captured import capture
from fxckpt.cost.annotate import annotate
from fxckpt.cost.bridge import problem_of
from fxckpt.cost.refined import FORWARD_SHARE, LIMITS, in_step_factor, refined, scale


def test_the_factor_holds_inside_its_context_only() -> None:
    assert scale() == 1.0
    with refined(2.0):
        assert scale() == 2.0
        with refined(0.5):
            assert scale() == 0.5
        assert scale() == 2.0
    assert scale() == 1.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_factor_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match="a price factor must be a positive number"):
        with refined(bad):
            pass


def test_the_factor_is_measured_time_over_priced_time_less_the_segments_forward_overhead() -> None:
    # 3 runs took 10 ms; each includes half a 2 ms segment overhead: 7 ms of ops. Priced at
    # 1e9 FLOP-equivalents at 1e11 per second: 10 ms. Factor 0.7.
    assert FORWARD_SHARE == 0.5
    assert in_step_factor(0.010, 1e9, 3, 1e11, 0.002) == pytest.approx(0.7)
    assert in_step_factor(0.010, 1e9, 3, 1e11, 0.0) == pytest.approx(1.0)
    assert in_step_factor(1.0, 1e9, 3, 1e11, 0.0) == LIMITS[1]  # 100x: held at 4
    assert in_step_factor(0.001, 1e9, 3, 1e11, 0.002) == LIMITS[0]  # all overhead: held at 1/4
    assert in_step_factor(0.010, 1e9, 0, 1e11, 0.0) == 1.0  # nothing timed
    assert in_step_factor(0.010, 0.0, 3, 1e11, 0.0) == 1.0  # nothing priced


def test_a_refined_problem_prices_every_op_at_the_factor_and_keeps_the_overheads() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    gm = capture(model, (x,), {}).gm
    annotate(gm, (x,))
    plain = problem_of(gm)
    with refined(2.5):
        dear = problem_of(gm)
    assert [op.name for op in dear.ops] == [op.name for op in plain.ops]
    assert any(op.cost > 0 for op in plain.ops)
    for a, b in zip(plain.ops, dear.ops):
        assert b.cost == pytest.approx(2.5 * a.cost)
        assert b.out_bytes == a.out_bytes
    assert (dear.segment_overhead, dear.keep_overhead, dear.saved_overhead) == (
        plain.segment_overhead, plain.keep_overhead, plain.saved_overhead)

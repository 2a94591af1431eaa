"""The segment clock: each checkpointed segment's first run timed while a clock is on, never its
recompute, never without a clock, never in eval or under no_grad."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.clock import SegmentClock, Timed, running_clock, timing
from fxckpt.runtime.segment import SegmentModule


def _stack() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def _segments(tm: nn.Module) -> list[SegmentModule]:
    gm = fxckpt.inspect(tm).graph_module
    return [m for m in gm.modules() if isinstance(m, SegmentModule)]


def test_a_step_times_each_segment_once_at_the_price_its_plan_gave_it() -> None:
    tm = fxckpt.transform(_stack(), every=1, capture="graph")
    x = torch.randn(8, 16, requires_grad=True)
    tm(x).sum().backward()  # planned, untimed
    segments = _segments(tm)
    assert len(segments) == 4 and all(s.forward_cost > 0 for s in segments)
    clock = SegmentClock()
    with timing(clock):
        assert running_clock() is clock
        out = tm(x)
    assert running_clock() is None
    after_forward = clock.timed()
    out.sum().backward()  # the recomputes are not timed
    timed = clock.timed()
    assert timed == after_forward
    assert timed.runs == 4
    assert timed.cost == pytest.approx(sum(s.forward_cost for s in segments))
    assert timed.seconds > 0


def test_the_plan_prices_each_segment_by_its_nodes() -> None:
    tm = fxckpt.transform(_stack(), every=2, capture="graph")
    tm(torch.randn(8, 16)).sum().backward()
    plan = fxckpt.inspect(tm).plan
    costs = [s.forward_cost for s in plan.segments]
    assert len(costs) == 2 and costs[0] == pytest.approx(costs[1]) and costs[0] > 0
    assert [s.forward_cost for s in _segments(tm)] == costs  # lowered with the plan's price
    again = type(plan).from_dict(plan.to_dict())
    assert [s.forward_cost for s in again.segments] == costs


def test_no_clock_no_timing_and_eval_or_no_grad_never_timed() -> None:
    tm = fxckpt.transform(_stack(), every=1, capture="graph")
    x = torch.randn(8, 16)
    tm(x).sum().backward()
    segment = _segments(tm)[0]
    clock = SegmentClock()
    checkpoint(segment, torch.randn(8, 16, requires_grad=True))  # no clock on
    with timing(clock):
        with torch.no_grad():
            tm(x)  # the model's own forward: no segment runs
            checkpoint(segment, torch.randn(8, 16))  # simply called
        segment.eval()
        checkpoint(segment, torch.randn(8, 16, requires_grad=True))  # simply called
        segment.train()
        assert clock.timed().runs == 0
        checkpoint(segment, torch.randn(8, 16, requires_grad=True))
    assert clock.timed().runs == 1


def test_timed_adds_up_what_it_saw() -> None:
    clock = SegmentClock()
    segment = nn.Linear(2, 2)
    segment.forward_cost = 5.0  # type: ignore[assignment]
    for _ in range(3):
        with clock.run(segment, torch.device("cpu")):
            time.sleep(0.002)
    timed = clock.timed()
    assert isinstance(timed, Timed)
    assert timed.runs == 3 and timed.cost == 15.0
    assert 0.006 <= timed.seconds < 1.0

"""The segment clock: each checkpointed segment's first run timed while a clock is on, never its
recompute, never without a clock, never in eval or under no_grad. The pass clock: a call's
forward, and the backward through its outputs, without the loss's."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.clock import PassClock, SegmentClock, Timed, running_clock, timing
from fxckpt.runtime.segment import SegmentModule
from support import Slow


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


def test_the_pass_clock_times_the_call_and_the_backward_through_its_outputs_not_the_loss() -> None:
    clock = PassClock(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)
    clock.start()
    out = clock.saw(Slow.apply(x, 0.05, 0.1))
    assert clock.seconds()[1:] == (None, None)  # no backward yet
    loss = Slow.apply(out, 0.2, 0.3).sum()  # a slow loss, outside the call
    loss.backward()
    forward, backward, span = clock.seconds()
    assert forward is not None and 0.05 <= forward < 0.2
    assert backward is not None and 0.1 <= backward < 0.3  # the loss's 0.3 s left out
    assert span is not None and span >= forward + 0.2 + 0.3 + backward  # but in the span
    assert x.grad is not None
    again = torch.randn(4, requires_grad=True)
    Slow.apply(again, 0.0, 0.2).sum().backward()  # another backward: not this call's
    assert clock.seconds()[1] == backward


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    count: int


@pytest.mark.parametrize("wrap", [lambda t: t, lambda t: {"out": [t]}, lambda t: _Output(t, 3)],
                         ids=["tensor", "dict of lists", "dataclass"])
def test_the_pass_clock_finds_the_outputs_in_containers_and_dataclasses(wrap) -> None:
    clock = PassClock(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)
    clock.start()
    out = Slow.apply(x, 0.0, 0.05)
    assert clock.saw(wrap(out)) is not None
    out.sum().backward()
    assert (clock.seconds()[1] or 0.0) >= 0.05


def test_the_pass_clock_times_no_backward_where_no_output_needs_one() -> None:
    clock = PassClock(torch.device("cpu"))
    clock.start()
    with torch.no_grad():
        out = clock.saw(torch.randn(4, requires_grad=True) * 2)
    assert out.shape == (4,)
    forward, backward, span = clock.seconds()
    assert forward is not None and forward >= 0 and backward is None and span is None

"""The recompute of a segment stops at its last saved tensor (torch's non-reentrant checkpoint),
and keeping an op's output has a fixed price: both in the solver's costs, checked on small
problems whose costs can be worked out by hand, and against FLOPs a real step runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxckpt
from fxckpt.solver import Op, Problem
from fxckpt.solver.selective import keep_within


def _chain(early_stop: bool = True, keep_overhead: float = 0.0) -> Problem:
    """x -> a (saves its output, like tanh) -> b (saves its input a, like a matmul) -> c (saves
    nothing, like an add) -> d (saves c)."""
    return Problem(ops=(
        Op(name="a", out_bytes=8, cost=1.0, inputs=("x",), saves=("a",)),
        Op(name="b", out_bytes=8, cost=10.0, inputs=("a",), saves=("a",)),
        Op(name="c", out_bytes=8, cost=5.0, inputs=("b",)),
        Op(name="d", out_bytes=8, cost=2.0, inputs=("c",), saves=("c",)),
    ), outputs=("d",), early_stop=early_stop, keep_overhead=keep_overhead)


def test_the_recompute_stops_before_the_last_saver_of_inputs_only() -> None:
    ix = _chain().index
    assert ix.recompute_end(0, 3) == 1 and ix.segment_cost(0, 3) == 1.0  # a only: b saves a
    assert ix.recompute_end(0, 2) == 1 and ix.segment_cost(0, 2) == 1.0
    assert ix.recompute_end(1, 3) == 1 and ix.segment_cost(1, 3) == 0.0  # nothing to run again
    assert ix.recompute_end(0, 4) == 3 and ix.segment_cost(0, 4) == 16.0  # d saves c: a, b, c
    plain = _chain(early_stop=False).index
    assert plain.recompute_end(0, 3) == 3 and plain.segment_cost(0, 3) == 16.0


def test_an_op_saving_hidden_tensors_runs_its_kernel_again() -> None:
    problem = Problem(ops=(
        Op(name="a", out_bytes=8, cost=1.0, inputs=("x",), saves=("x",)),
        Op(name="drop::saved", out_bytes=8, cost=0.0, grad_bytes=0, hidden=True),
        Op(name="drop", out_bytes=8, cost=7.0, inputs=("a",), saves=("drop::saved",)),
        Op(name="e", out_bytes=8, cost=3.0, inputs=("drop",)),
    ), outputs=("e",), early_stop=True)
    ix = problem.index
    assert ix.recompute_end(0, 4) == 3 and ix.segment_cost(0, 4) == 8.0  # a and drop, not e


def test_keeping_saves_an_op_s_cost_less_the_overhead_and_nothing_past_the_stop() -> None:
    ix = _chain(keep_overhead=4.0).index
    assert ix.gain == (-3.0, 6.0, 1.0, -2.0)
    assert ix.kept_gain([(0, 4)], [1]) == 6.0
    assert ix.kept_gain([(0, 3)], [1]) == 0.0  # b is past that segment's stop: never run again
    # a costs less than keeping it: not kept even with memory to spare; b is.
    assert keep_within(_chain(keep_overhead=4.0), [(0, 4)], 10**6, [(0,), (1,)]).keep == (1,)


@pytest.mark.parametrize("value", [-1.0, float("inf"), True, "1"])
def test_a_bad_keep_overhead_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="Problem.keep_overhead must be a finite number >= 0"):
        Problem(ops=(Op(name="a", out_bytes=1, cost=1.0),), outputs=("a",),
                keep_overhead=value)  # type: ignore[arg-type]


class TanhThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(64, 64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _step_flops(module: nn.Module, x: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        module(x).square().mean().backward()
    return counter.get_total_flops()


def test_a_segment_ending_in_a_matmul_does_not_run_it_again() -> None:
    """Each block is a segment (``depth=2``); its recompute runs the tanh, whose output the
    matmul saves, and stops before the matmul: the plan says so, and so do the FLOPs."""
    torch.manual_seed(0)
    model, x = TanhThenLinear().train(), torch.randn(32, 64, requires_grad=True)
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2, example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert len(plan.segments) == 3
    assert all(s.recomputed_ops == ("tanh",) and s.recompute_flops == 0 for s in plan.segments)
    assert _step_flops(tm, x) == _step_flops(eager, x)

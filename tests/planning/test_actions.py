"""planning/actions.py: under ``offload="auto"`` each segment recomputes or offloads, whichever
the problem prices lower; the plan's note says how many of each."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from fxckpt.plan import SegmentSpec
from fxckpt.planning.actions import decide_actions
from fxckpt.solver import Op, Problem


def _problem(per_byte: float) -> Problem:
    """``a -> b -> c -> d -> loss``, 100-byte outputs each saved by the next op; ``c`` is
    expensive to run again (1000), the others cheap (10)."""
    ops = (Op(name="a", out_bytes=100, cost=10, inputs=("x",), saves=("x",)),
           Op(name="b", out_bytes=100, cost=10, inputs=("a",), saves=("a",)),
           Op(name="c", out_bytes=100, cost=1000, inputs=("b",), saves=("b",)),
           Op(name="d", out_bytes=100, cost=10, inputs=("c",), saves=("c",)),
           Op(name="loss", out_bytes=4, cost=0, inputs=("d",), saves=("d",), grad_bytes=0))
    return Problem(ops=ops, outputs=("loss",), offload_cost_per_byte=per_byte)


def _segment(name: str, nodes: tuple[str, ...]) -> SegmentSpec:
    return SegmentSpec(name=name, nodes=nodes, module_paths=(), inputs=(), outputs=(),
                       saved_bytes=0, freed_bytes=0, recompute_flops=0, restores=(),
                       reason="test")


def _runs(*names: tuple[str, ...]) -> list[list[Any]]:
    return [[SimpleNamespace(name=n) for n in run] for run in names]


def test_the_expensive_segment_offloads_and_the_cheap_one_recomputes() -> None:
    # moving a byte out and back costs 0.15: the cheap segment's 200 saved bytes cost 30 to
    # move against 20 to recompute; the expensive one's 100 bytes cost 15 against 1000
    segments = (_segment("segment_0", ("a", "b")), _segment("segment_1", ("c",)))
    chosen, note = decide_actions(_problem(0.15), segments, _runs(("a", "b"), ("c",)))
    assert [s.action for s in chosen] == ["recompute", "offload"]
    assert [dataclasses.replace(s, action="recompute") for s in chosen] == list(segments)
    assert note == ("offload='auto': 1 of 2 segment(s) offload, the rest recompute (moving a "
                    "byte costs 0.15 FLOP-equivalents)")


def test_free_moves_offload_every_segment_and_dear_ones_none() -> None:
    segments = (_segment("segment_0", ("a", "b")), _segment("segment_1", ("c",)))
    runs = _runs(("a", "b"), ("c",))
    assert [s.action for s in decide_actions(_problem(0.0), segments, runs)[0]] == \
        ["offload", "offload"]
    chosen, note = decide_actions(_problem(100.0), segments, runs)
    assert [s.action for s in chosen] == ["recompute", "recompute"]
    assert note.startswith("offload='auto': 0 of 2 segment(s) offload")

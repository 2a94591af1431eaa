"""planning/select.py: a strategy's runs, the rules every segment obeys, and the Plan's facts."""

from __future__ import annotations

import torch

from fxckpt.config import TransformConfig
from fxckpt.cost.annotate import annotate, info
from fxckpt.capture.graphs import planned_nodes
from fxckpt.planning.select import select
from fxckpt.strategy import Depth, Every
from handmade import Tiny, traced


def _annotated() -> torch.fx.GraphModule:
    x = torch.randn(3, 4)
    return annotate(traced(Tiny(), x), [x])


def _select(config: TransformConfig, **kwargs: object) -> object:
    return select(_annotated(), config, capture="symbolic_trace", training=True,
                  signature="(float32[3, 4])", **kwargs)


def test_every_unit_of_work_is_a_segment_and_the_plan_adds_up() -> None:
    gm = _annotated()
    plan = select(gm, TransformConfig(strategy=Every(1)), capture="symbolic_trace",
                  training=True, signature="(float32[3, 4])")
    order = list(planned_nodes(gm.graph))
    assert plan.node_count == len(order)
    assert plan.total_flops == sum(info(n).flops for n in order) == 2 * 3 * (4 * 8 + 8 * 8 + 8 * 2)
    assert [s.name for s in plan.segments] == [f"segment_{i}" for i in range(len(plan.segments))]
    assert plan.segments and all(s.reason.startswith("every=1") for s in plan.segments)
    # on tensors this small, what checkpoint saves outweighs what it frees: every=1 does not
    # promise less memory, and the prediction says so
    assert plan.eager_peak == 600 and plan.predicted_peak == 672
    for s in plan.segments:  # a segment's inputs come from outside it, its nodes in order
        assert not set(s.inputs) & set(s.nodes)
        assert list(s.nodes) == [n.name for n in order if n.name in s.nodes]


def test_a_hooked_module_is_never_inside_a_segment_and_a_note_says_so() -> None:
    plain = _select(TransformConfig(strategy=Every(1)))
    assert any("fc2" in s.nodes for s in plain.segments)
    plan = _select(TransformConfig(strategy=Every(1)), hooked={"fc2": "fc2"})
    assert all("fc2" not in s.nodes for s in plan.segments)
    assert any("fc2" in note for note in plan.notes)


def test_a_depth_with_no_modules_says_there_are_no_segments() -> None:
    plan = _select(TransformConfig(strategy=Depth(3)))
    assert plan.segments == ()
    assert plan.notes == ("nothing is checkpointed: the strategy found no segment",)

"""flatten: inlining a lowered graph's segments gives back the graph the plan was made on.

Same node names, ops, targets and annotations as the annotated graph before lowering, the same
values when run, getitem unpacking of multi-output segments resolved, and clear errors when the
lowered graph no longer matches its plan. ``labelled_graph`` labels nodes with segment and stage.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
from handmade import Tiny, plan, segment, traced

from fxckpt.errors import PlanError
from fxckpt.cost.annotate import META_KEY, annotate
from fxckpt.passes.lower import lower
from fxckpt.passes.flatten import flatten, labelled_graph, segment_call_name
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.plan import PipelineView

FC1 = segment("segment_0", ("fc1", "relu"), ("x",), ("relu",))
FC2 = segment("segment_1", ("fc2", "tanh", "mul"), ("relu",), ("mul",))
DROP = segment("segment_2", ("add", "drop"), ("mul", "relu"), ("drop",))
WIDE = segment("segment_0", ("fc1", "relu", "fc2", "tanh", "mul"), ("x",), ("relu", "mul"))

CASES = {"three": (FC1, FC2, DROP), "two-outputs": (WIDE,), "middle": (FC2,), "none": ()}


def original_and_lowered(segments: tuple, model: nn.Module | None = None,
                         **kw) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    model = model if model is not None else Tiny()
    x = torch.randn(3, 4)
    gm = traced(model, x)
    annotate(gm, [x])
    return gm, lower(copy_graph_module(gm), plan(*segments, **kw))


def structure(gm: torch.fx.GraphModule) -> list[tuple[str, str, object]]:
    return [(n.name, n.op, n.target) for n in gm.graph.nodes]


@pytest.mark.parametrize("segments", list(CASES.values()), ids=list(CASES))
def test_flat_graph_is_the_graph_the_plan_was_made_on(segments: tuple) -> None:
    original, gm = original_and_lowered(segments)
    flat = flatten(gm, plan(*segments))
    assert structure(flat) == structure(original)
    for a, b in zip(flat.graph.nodes, original.graph.nodes):
        assert [x.name for x in a.all_input_nodes] == [x.name for x in b.all_input_nodes]
        if b.op != "output":
            assert a.meta[META_KEY] == b.meta[META_KEY], a.name


@pytest.mark.parametrize("segments", list(CASES.values()), ids=list(CASES))
def test_flat_graph_computes_what_the_lowered_one_does(segments: tuple) -> None:
    model = Tiny().eval()
    _, gm = original_and_lowered(segments, model=model, training=False)
    flat = flatten(gm, plan(*segments, training=False))
    x = torch.randn(3, 4)
    assert torch.equal(flat(x), model(x))
    assert torch.equal(flat(x), gm.eval()(x))


def test_flat_graph_shares_the_lowered_modules_and_tensors() -> None:
    model = Tiny()
    _, gm = original_and_lowered((FC1, FC2), model=model)
    flat = flatten(gm, plan(FC1, FC2))
    assert flat.fc1 is model.fc1 and flat.get_buffer("scale") is model.scale
    assert not any(n.op == "get_attr" and str(n.target).startswith("segment")
                   for n in flat.graph.nodes)


def test_segment_call_name() -> None:
    _, gm = original_and_lowered((FC1, FC2))
    names = {"segment_0", "segment_1"}
    found = {n.name: segment_call_name(n, names) for n in gm.graph.nodes}
    calls = {k: v for k, v in found.items() if v is not None}
    assert sorted(calls.values()) == ["segment_0", "segment_1"]
    assert found["x"] is None and found["head"] is None and found["segment_0"] is None
    assert all(v is None for v in (segment_call_name(n, set()) for n in gm.graph.nodes))


def test_call_with_the_wrong_number_of_inputs_is_a_plan_error() -> None:
    _, gm = original_and_lowered((FC1, FC2))
    call = next(n for n in gm.graph.nodes if segment_call_name(n, {"segment_1"}))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    call.args = (*call.args, x)
    with pytest.raises(PlanError, match="segment takes 1 inputs but is called with 2"):
        flatten(gm, plan(FC1, FC2))


def test_segment_that_is_not_a_graph_module_is_a_plan_error() -> None:
    _, gm = original_and_lowered((FC1,))
    gm.segment_0 = nn.Identity()
    with pytest.raises(PlanError, match="Identity is not a lowered segment"):
        flatten(gm, plan(FC1))


def test_segment_graph_without_output_is_a_plan_error() -> None:
    _, gm = original_and_lowered((FC1,))
    sub = gm.segment_0
    sub.graph.erase_node(next(n for n in sub.graph.nodes if n.op == "output"))
    with pytest.raises(PlanError, match="segment graph has no output"):
        flatten(gm, plan(FC1))


def test_the_labelled_graph_labels_segments_and_stages() -> None:
    _, gm = original_and_lowered((FC1, FC2))
    call_1 = next(n.name for n in gm.graph.nodes if segment_call_name(n, {"segment_1"}))
    stage_of = {call_1: 1, "add": 1, "drop": 2, "head": 2}
    pipeline = PipelineView(stages=(), chunks=1, checkpoint="never", stop=0, method="balanced",
                            stage_of=stage_of)
    view = labelled_graph(gm, plan(FC1, FC2, pipeline=pipeline))
    labels = {n: (d["segment"], d["stage"]) for n, d in view.nodes(data=True)}
    assert labels == {
        "x": (None, None),
        "fc1": ("segment_0", None), "relu": ("segment_0", None),  # its call has no stage
        "fc2": ("segment_1", 1), "tanh": ("segment_1", 1), "mul": ("segment_1", 1),
        "add": (None, 1), "drop": (None, 2), "head": (None, 2),
    }
    assert set(view.edges) >= {("x", "fc1"), ("relu", "fc2"), ("mul", "add"), ("relu", "add")}

"""graphs.py: the fx helpers every pass shares."""

from __future__ import annotations

import importlib

import torch
import torch.fx
from torch import nn

from fxckpt.capture.graphs import compute_nodes, copy_nodes, is_guard, outermost, planned_nodes


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)).mul(self.scale).sum(-1)


def test_compute_nodes_are_the_calls_in_order() -> None:
    gm = torch.fx.symbolic_trace(Small())
    assert [n.op for n in gm.graph.nodes] == [
        "placeholder", "call_module", "call_function", "get_attr", "call_method", "call_method",
        "output"]
    assert [n.name for n in compute_nodes(gm.graph)] == ["fc", "relu", "mul", "sum_1"]
    assert [n.name for n in planned_nodes(gm.graph)] == ["fc", "relu", "mul", "sum_1"]


def test_guards_are_computed_but_never_planned() -> None:
    gm = torch.fx.symbolic_trace(Small())
    gm.add_submodule("_guards_fn", nn.Identity())
    x = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(x):
        guard = gm.graph.call_module("_guards_fn", (x,))
    assert is_guard(guard)
    assert guard in list(compute_nodes(gm.graph))
    assert guard not in planned_nodes(gm.graph)


def test_annotate_reexports_the_same_helpers() -> None:
    annotate_module = importlib.import_module("fxckpt.cost.annotate")
    assert annotate_module.compute_nodes is compute_nodes
    assert annotate_module.planned_nodes is planned_nodes
    assert annotate_module.is_guard is is_guard


def test_copy_nodes_reads_state_where_it_is_used() -> None:
    model = Small()
    gm = torch.fx.symbolic_trace(model)
    nodes = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    env[nodes["relu"]] = graph.placeholder("relu")
    copy_nodes(graph, [nodes["mul"], nodes["sum_1"]], env)
    graph.output(env[nodes["sum_1"]])
    sub = torch.fx.GraphModule(gm, graph)
    assert [(n.op, str(n.target)) for n in sub.graph.nodes] == [
        ("placeholder", "relu"), ("get_attr", "scale"), ("call_method", "mul"),
        ("call_method", "sum"), ("output", "output")]
    assert sub.scale is model.scale  # shared, not copied
    h = torch.randn(2, 3)
    torch.testing.assert_close(sub(h), (h * 2.0).sum(-1), rtol=0, atol=0)


def test_outermost_drops_nested_paths_and_keeps_the_order_they_ran_in() -> None:
    assert outermost(["layers.0.fc", "layers.0", "head"]) == ("layers.0", "head")
    assert outermost(["layers.2.fc", "head", "layers.0", "layers.2"]) == (
        "layers.2", "head", "layers.0")
    assert outermost(["", "a.b"]) == ("<root>", "a.b")
    assert outermost([]) == ()

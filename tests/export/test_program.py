"""export/program.py: a graph as a list of nodes and the graph rebuilt from it with torch.fx's
API; every string torch.fx prints into generated code is checked first."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx

from fxckpt.export import ExportError
from fxckpt.export.program import build_graph, check_part, describe_graph, install


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)).view(-1) * 2


def _round_trip(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    data = json.loads(json.dumps(describe_graph(gm, "the graph")))
    graph, info = build_graph(data, "the graph")
    loaded = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    loaded.fc = gm.fc
    install(loaded, graph, info, "the graph")
    return loaded


def test_a_graph_is_saved_as_nodes_and_methods_as_tensor_functions() -> None:
    data = describe_graph(torch.fx.symbolic_trace(Small()), "the graph")
    assert data["pytree"] is None
    assert [(n["name"], n["op"], n["target"]) for n in data["nodes"]] == [
        ("x", "placeholder", "x"), ("fc", "call_module", "fc"),
        ("relu", "call_function", "torch.relu"),
        ("view", "call_function", "torch.Tensor.view"),
        ("mul", "call_function", "operator.mul"), ("output", "output", "output")]
    assert data["nodes"][3]["args"] == [{"__node__": "relu"}, -1]


def test_the_rebuilt_graph_computes_what_the_traced_one_does() -> None:
    gm = torch.fx.symbolic_trace(Small())
    loaded = _round_trip(gm)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), gm(x))
    assert [n.op for n in loaded.graph.nodes] == ["placeholder", "call_module", "call_function",
                                                  "call_function", "call_function", "output"]


def test_a_method_off_the_list_is_refused_at_save_naming_the_node() -> None:
    class Saves(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.register_hook(None)

    with pytest.raises(ExportError, match="^node 'register_hook' .* of the graph calls the "
                                          "method 'register_hook'"):
        describe_graph(torch.fx.symbolic_trace(Saves()), "the graph")


def _data(*nodes: dict) -> dict:
    return {"pytree": None, "nodes": [*nodes, {"name": "output", "op": "output",
                                               "target": "output", "args": [None],
                                               "kwargs": {}}]}


def _placeholder(name: str) -> dict:
    return {"name": name, "op": "placeholder", "target": name, "args": [], "kwargs": {}}


@pytest.mark.parametrize("data, message", [
    ({"nodes": []}, "has no node list"),
    ({"nodes": ["x"]}, "node 0 is not an object"),
    (_data(_placeholder("x"), _placeholder("x")), "a node name must be a new Python identifier"),
    (_data(_placeholder("self")), "a node name must be a new Python identifier"),
    (_data(_placeholder("a b")), "a node name must be a new Python identifier"),
    ({"nodes": [_placeholder("x")]}, "a graph has exactly one output node, its last"),
])
def test_a_malformed_node_list_is_refused(data: dict, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        build_graph(data, "programs/v0/segment_0.json")


def test_install_refuses_a_call_of_something_that_is_not_a_module() -> None:
    data = _data(_placeholder("x"), {"name": "w", "op": "call_module", "target": "weight",
                                     "args": [{"__node__": "x"}], "kwargs": {}})
    graph, info = build_graph(data, "g")
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.register_buffer("weight", torch.ones(1))
    with pytest.raises(ExportError, match="^node 'w' of g calls 'weight', which is not a module"):
        install(gm, graph, info, "g")


def test_install_refuses_a_torch_nn_container() -> None:
    data = _data(_placeholder("x"), {"name": "c", "op": "get_attr", "target": "blocks",
                                     "args": [], "kwargs": {}})
    graph, info = build_graph(data, "g")
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.blocks = torch.nn.ModuleList([torch.nn.ReLU()])
    with pytest.raises(ExportError, match="reaches the container 'blocks'"):
        install(gm, graph, info, "g")


@pytest.mark.parametrize("part, ok", [("layers", True), ("0", True), ("_x", True),
                                      ("__class__", False), ("a.b", False), ("", False),
                                      (0, False)])
def test_check_part(part: object, ok: bool) -> None:
    assert check_part(part) is ok

"""export/views.py: a graph view written as JSON and read back is the same graph, tuples
included."""

from __future__ import annotations

import json

import networkx as nx

from fxckpt.export.views import view_from_json, view_to_json


def _view() -> nx.DiGraph:
    view = nx.DiGraph(name="mlp", inputs=("x", "y"))
    view.add_node("fc1", kind="call_module", bytes=128, path=("layers", "0"))
    view.add_node("relu", kind="call_function", bytes=128, cost=1.5)
    view.add_edge("fc1", "relu")
    return view


def test_a_view_round_trips_with_its_attributes_and_edges() -> None:
    back = view_from_json(view_to_json(_view()))
    assert back.graph == {"name": "mlp", "inputs": ("x", "y")}
    assert dict(back.nodes(data=True)) == dict(_view().nodes(data=True))
    assert list(back.edges()) == [("fc1", "relu")]
    assert list(back.nodes) == ["fc1", "relu"]  # order kept


def test_the_layout_is_a_small_fixed_one_not_networkxs_node_link() -> None:
    data = json.loads(view_to_json(_view()))
    assert set(data) == {"graph", "nodes", "edges"}
    assert data["nodes"][0] == ["fc1", {"kind": "call_module", "bytes": 128,
                                        "path": ["layers", "0"]}]
    assert data["edges"] == [["fc1", "relu"]]
    assert " " not in view_to_json(_view())  # compact separators


def test_an_empty_view_round_trips() -> None:
    back = view_from_json(view_to_json(nx.DiGraph()))
    assert back.graph == {} and len(back) == 0

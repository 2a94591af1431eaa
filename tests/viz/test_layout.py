"""viz/layout.py: where each box of the graph picture goes and which ops share a box: labels,
plumbing left out, runs collapsed by module without merging segments or stages, positions."""

from __future__ import annotations

import networkx as nx
import pytest

from fxckpt.viz.layout import (collapse, hide_plumbing, layered_positions, layout, op_label,
                               parse_plain)


@pytest.mark.parametrize("name, path, label", [
    ("layers_0_fc", "layers.0.fc", "layers.0.fc"),  # a module call: its path
    ("layers_0_fc_2", "layers.0.fc", "layers.0.fc"),  # called again: the counter dropped
    ("gelu_3", "layers.0", "layers.0: gelu"),  # an op inside a module
    ("add_1", "", "add_1"),  # an op of the model's own forward
])
def test_nodes_are_labelled_by_module_path(name: str, path: str, label: str) -> None:
    assert op_label(name, path) == label


def _view() -> nx.DiGraph:
    """x -> a (layers.0, segment_0) -> view -> b (layers.0, segment_0) -> c (layers.1)"""
    view = nx.DiGraph()
    view.add_node("x", kind="input")
    for name, path, segment, nbytes in (("a", "layers.0.fc", "segment_0", 8),
                                        ("view", "layers.0", "segment_0", 0),
                                        ("b", "layers.0.act", "segment_0", 8),
                                        ("c", "layers.1.fc", None, 8)):
        view.add_node(name, kind="op", module_path=path, segment=segment, stage=None,
                      out_bytes=nbytes, cost=float(nbytes))
    nx.add_path(view, ["x", "a", "view", "b", "c"])
    return view


def test_plumbing_is_left_out_its_inputs_joined_to_its_users() -> None:
    view, ops = hide_plumbing(_view(), ["a", "view", "b", "c"])
    assert ops == ["a", "b", "c"] and "view" not in view
    assert ("a", "b") in view.edges and "view" in _view()  # a copy: the view is left alone
    same, kept = hide_plumbing(view, ops)
    assert same is view and kept == ops


def test_few_ops_are_drawn_one_box_each() -> None:
    boxes, graph = collapse(_view(), ["a", "view", "b", "c"], max_nodes=10)
    assert [(b.name, b.label, b.kind, b.segment) for b in boxes] == [
        ("x", "x", "input", None), ("a", "layers.0.fc: a", "op", "segment_0"),
        ("view", "layers.0: view", "op", "segment_0"), ("b", "layers.0.act: b", "op", "segment_0"),
        ("c", "layers.1.fc: c", "op", None)]
    assert list(graph.edges) == [("x", "a"), ("a", "view"), ("view", "b"), ("b", "c")]


def test_many_ops_collapse_to_module_runs_that_keep_segments_apart() -> None:
    boxes, graph = collapse(_view(), ["a", "view", "b", "c"], max_nodes=2)
    groups = [(b.label, b.ops, b.segment) for b in boxes if b.kind == "group"]
    assert groups == [("layers.0", ["a", "view", "b"], "segment_0"), ("layers.1", ["c"], None)]
    assert list(graph.edges) == [("x", "layers.0#0"), ("layers.0#0", "layers.1#1")]
    boxes, _ = collapse(_view(), ["a", "view", "b", "c"], max_nodes=1)  # cannot fit: depth 0
    groups = [(b.label, b.ops) for b in boxes if b.kind == "group"]
    assert groups == [("<root>", ["a", "view", "b"]), ("<root>", ["c"])]  # segments never merge


def test_layered_positions_put_each_node_a_layer_below_its_deepest_input() -> None:
    graph = nx.DiGraph([("x", "a"), ("x", "b"), ("a", "c"), ("b", "c"), ("x", "c")])
    assert layered_positions(graph) == {"x": (0.0, 0.0), "a": (-0.5, -1.0), "b": (0.5, -1.0),
                                        "c": (0.0, -2.0)}


def test_graphviz_plain_output_is_read_by_original_name() -> None:
    text = "graph 1 2 2\nnode n0 1.5 2.0 1 1 x\nnode n9 0 0 1 1 y\nedge n0 n1\nstop"
    assert parse_plain(text, {"n0": "x", "n1": "a"}) == {"x": (1.5, 2.0)}


def test_the_layout_engine_is_checked_and_layered_needs_no_graphviz() -> None:
    graph = nx.DiGraph([("x", "a")])
    assert layout(graph, "layered") == ({"x": (0.0, 0.0), "a": (0.0, -1.0)}, "layered")
    with pytest.raises(ValueError, match=r"^layout must be 'auto', 'dot' or 'layered' \(got "
                                         r"'neato'\)$"):
        layout(graph, "neato")


def test_asking_for_dot_without_graphviz_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"needs Graphviz's dot program on PATH"):
        layout(nx.DiGraph([("x", "a")]), "dot")
    assert layout(nx.DiGraph([("x", "a")]), "auto")[1] == "layered"

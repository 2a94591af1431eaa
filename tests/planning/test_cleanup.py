"""planning/cleanup.py: the rules every segment obeys, on hand-edited annotations of ``Tiny``.

``Tiny``'s planned nodes: fc1 relu fc2 tanh mul add drop head (relu is read by fc2 and add).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
import torch.nn as nn

from fxckpt.cost.annotate import META_KEY, annotate, info, planned_nodes
from fxckpt.planning.cleanup import (apply_force, contiguous, force_notes, frees_memory,
                                   opaque_modules, pinned, safe, without_hooked)
from handmade import Tiny, traced


def _graph() -> tuple[list[torch.fx.Node], dict[str, torch.fx.Node]]:
    x = torch.randn(3, 4)
    gm = annotate(traced(Tiny(), x), [x])
    order = list(planned_nodes(gm.graph))
    return order, {n.name: n for n in gm.graph.nodes}


def _edit(n: torch.fx.Node, **fields: object) -> None:
    n.meta[META_KEY] = dataclasses.replace(info(n), **fields)


def _names(runs: list[list[torch.fx.Node]]) -> list[list[str]]:
    return [[n.name for n in r] for r in runs]


def test_pinned_takes_the_innermost_path() -> None:
    _, by = _graph()
    _edit(by["fc2"], module_path="enc.layer.fc2")
    force = {"enc": "recompute", "enc.layer": "save", "en": "recompute"}
    assert pinned(by["fc2"], force) == "save"
    assert pinned(by["fc2"], {"enc": "recompute"}) == "recompute"
    assert pinned(by["fc2"], {"enc.lay": "save"}) is None  # a prefix is not a parent
    assert pinned(by["fc1"], force) is None


def test_contiguous_splits_where_nodes_skip() -> None:
    order, by = _graph()
    got = contiguous([by[m] for m in ("fc1", "relu", "tanh", "mul", "head")], order)
    assert _names(got) == [["fc1", "relu"], ["tanh", "mul"], ["head"]]
    assert contiguous([], order) == []


def test_apply_force_removes_saves_and_adds_recomputes() -> None:
    order, _ = _graph()
    runs = [list(order)]
    assert apply_force(order, runs, {}) is runs
    got = apply_force(order, [order[:6]], {"fc2": "save", "drop": "recompute"})
    assert _names(got) == [["fc1", "relu"], ["tanh", "mul", "add"], ["drop"]]


def test_safe_starts_after_a_write_to_an_outside_tensor() -> None:
    _, by = _graph()
    run = [by[m] for m in ("fc2", "tanh", "mul", "add")]
    assert safe(run) == run
    _edit(by["mul"], mutates=("relu",))  # writes relu, made before the run
    assert [n.name for n in safe(run)] == ["add"]
    assert [n.name for n in safe([by["relu"]] + run)] == ["relu", "fc2", "tanh", "mul", "add"]
    assert safe([]) == []


def test_safe_ignores_writes_to_state() -> None:
    _, by = _graph()
    assert by["scale"].op == "get_attr"
    _edit(by["tanh"], mutates=("scale",))
    run = [by[m] for m in ("fc2", "tanh", "mul")]
    assert safe(run) == run


def test_safe_ends_before_a_tensor_written_later() -> None:
    _, by = _graph()
    _edit(by["head"], mutates=("tanh",))
    run = [by[m] for m in ("fc1", "relu", "fc2", "tanh", "mul")]
    assert [n.name for n in safe(run)] == ["fc1", "relu", "fc2"]
    assert safe([by["mul"], by["add"]]) == []  # mul reads tanh from outside


def test_a_view_of_a_written_tensor_counts_as_written() -> None:
    _, by = _graph()
    _edit(by["tanh"], aliases=("fc2",), new_bytes=0)
    _edit(by["head"], mutates=("fc2",))
    run = [by[m] for m in ("relu", "fc2", "tanh", "mul")]
    assert [n.name for n in safe(run)] == ["relu"]


def test_frees_memory() -> None:
    _, by = _graph()
    assert not frees_memory([by["fc2"]])  # its output lives on in tanh
    assert frees_memory([by["fc2"], by["tanh"]])
    assert info(by["drop"]).saves_internal_bytes == 96  # a 3x8 float mask, by hand: 3*8*4
    assert frees_memory([by["drop"]])
    _edit(by["tanh"], new_bytes=0)
    assert not frees_memory([by["tanh"]])


def test_without_hooked_cuts_out_hooked_modules_with_a_note() -> None:
    order, _ = _graph()
    runs = [order[:6]]
    assert without_hooked(order, runs, {}) == (runs, ())
    got, notes = without_hooked(order, runs, {"fc2": "fc2"})
    assert _names(got) == [["fc1", "relu"], ["tanh", "mul", "add"]]
    assert len(notes) == 1 and notes[0].startswith("fc2 has hooks")
    got, _ = without_hooked(order, [order[:3]], {"relu": "act"})
    assert _names(got) == []  # fc1 alone and fc2 alone free nothing


def test_force_notes_explain_pins_without_effect() -> None:
    order, _ = _graph()
    force = {"ghost": "recompute", "fc2": "recompute", "head": "save"}
    notes = force_notes(order, [order[:2]], force)
    assert len(notes) == 2
    assert "force['ghost']" in notes[0] and "no compute node" in notes[0]
    assert "force['fc2']" in notes[1] and "would free nothing" in notes[1]
    assert force_notes(order, [order[2:4]], {"fc2": "recompute"}) == ()


def test_a_pin_inside_an_opaque_module_names_the_module() -> None:
    order, by = _graph()
    gm = by["fc1"].graph.owning_module
    gm.add_submodule("box", nn.Sequential(nn.Linear(4, 8)))
    by["fc1"].target = "box"
    _edit(by["fc1"], module_path="box")
    assert opaque_modules(order) == [("box", "Sequential")]
    notes = force_notes(order, [], {"box.0": "recompute"})
    assert len(notes) == 1 and "inside box (Sequential)" in notes[0]
    assert "force 'box' instead" in notes[0]

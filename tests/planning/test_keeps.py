"""planning/keeps.py: which nodes selective recompute may keep, on ``Tiny``'s Problem.

Positions: 0 fc1  1 relu  2 fc2  3 tanh  4 mul  5 add  6 drop::saved  7 drop  8 head.
fc1, fc2 and head have FLOPs; tanh writes 96 B at a price far above KEEP_PRICE per byte.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxckpt.cost.annotate import META_KEY, annotate, info, planned_nodes
from fxckpt.cost.bridge import problem_of
from fxckpt.planning.keeps import KEEP_PRICE, choices, module_pins, op_pins
from fxckpt.cost.prices import CALL_PRICE
from fxckpt.solver import Problem
from handmade import Tiny, traced


def _setup() -> tuple[Problem, list[torch.fx.Node], dict[str, torch.fx.Node]]:
    x = torch.randn(3, 4)
    gm = annotate(traced(Tiny(), x), [x])
    order = list(planned_nodes(gm.graph))
    return problem_of(gm), order, {n.name: n for n in order}


def _edit(n: torch.fx.Node, **fields: object) -> None:
    n.meta[META_KEY] = dataclasses.replace(info(n), **fields)


def test_pins_split_by_prefix() -> None:
    force = {"op:aten.mm": "save", "op:aten.tanh.default": "recompute", "fc1": "save"}
    assert op_pins(force) == {"aten.mm": "save", "aten.tanh.default": "recompute"}
    assert module_pins(force) == {"fc1": "save"}
    assert op_pins({}) == {} and module_pins({}) == {}


def test_offered_are_flop_nodes_and_dear_memory_bound_ones() -> None:
    problem, _, by = _setup()
    tanh, relu = info(by["tanh"]), info(by["relu"])
    assert tanh.work - CALL_PRICE >= KEEP_PRICE * 96 > relu.work - CALL_PRICE
    assert choices(problem, list(by.values()), {}) == ([(0,), (2,), (3,), (8,)], [])


def test_op_pins_force_and_forbid() -> None:
    problem, order, _ = _setup()
    force = {"op:aten.addmm": "save", "op:aten.tanh.default": "recompute", "fc1": "save"}
    assert choices(problem, order, force) == ([], [(0,), (2,), (8,)])
    # a node is forbidden when any of its calls is pinned to recompute (addmm and t here)
    force = {"op:aten.addmm": "save", "op:aten.t": "recompute"}
    assert choices(problem, order, force) == ([(3,)], [])


def test_a_forced_node_is_kept_with_its_synthetic_op() -> None:
    problem, order, by = _setup()
    assert choices(problem, order, {"op:aten.bernoulli_": "save"}) == (
        [(0,), (2,), (3,), (8,)], [])  # dropout draws random numbers: never kept
    _edit(by["drop"], random=False)
    assert choices(problem, order, {"op:aten.bernoulli_": "save"})[1] == [(6, 7)]


def test_unsafe_nodes_are_never_offered() -> None:
    problem, order, by = _setup()
    _edit(by["fc1"], aliases=("x",))  # a view keeps nothing
    _edit(by["head"], writes_buffers=("scale",))
    _edit(by["mul"], mutates=("tanh",))  # tanh is written later: torch refuses to cache it
    assert choices(problem, order, {"op:aten.mul": "save"}) == ([(2,)], [])


def test_a_view_of_a_written_node_counts_as_written() -> None:
    problem, order, by = _setup()
    _edit(by["tanh"], flops=0)
    _edit(by["relu"], aliases=("fc2",))  # pretend: relu's storage is shared with fc2
    _edit(by["add"], mutates=("relu",))
    offered, _ = choices(problem, order, {})
    assert offered == [(0,), (3,), (8,)]  # fc2 is written through relu

"""cost/runs.py: node runs <-> the solver's op ranges, on ``Tiny``'s Problem.

``problem_of(Tiny)`` has the ops (position: name)::

    0 fc1  1 relu  2 fc2  3 tanh  4 mul  5 add  6 drop::saved  7 drop  8 head  9 loss::assumed
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from fxckpt.cost.annotate import annotate, planned_nodes
from fxckpt.cost.bridge import problem_of
from fxckpt.cost.runs import (keep_positions, kept_names, spans_of, recomputed, to_spans,
                                to_runs)
from fxckpt.solver import Problem
from handmade import Tiny, traced

OPS = ["fc1", "relu", "fc2", "tanh", "mul", "add", "drop::saved", "drop", "head",
       "loss::assumed"]


@pytest.fixture(scope="module")
def setup() -> tuple[Problem, dict[str, torch.fx.Node], list[torch.fx.Node]]:
    x = torch.randn(3, 4)
    gm = annotate(traced(Tiny(), x), [x])
    order = list(planned_nodes(gm.graph))
    problem = problem_of(gm)
    assert [op.name for op in problem.ops] == OPS
    return problem, {n.name: n for n in order}, order


Setup = tuple[Problem, dict[str, torch.fx.Node], list[torch.fx.Node]]


def test_to_spans_starts_at_a_synthetic_op(setup: Setup) -> None:
    problem, by, _ = setup
    runs = [[by["fc1"], by["relu"]], [by["drop"], by["head"]], [by["tanh"]]]
    assert to_spans(problem, runs) == ((0, 2), (6, 9), (3, 4))
    assert spans_of(problem, [["mul", "add"], ["drop"]]) == ((4, 6), (6, 8))
    assert to_spans(problem, []) == ()


def test_to_runs_drops_synthetic_ops_and_empty_runs(setup: Setup) -> None:
    problem, _, order = setup
    got = to_runs(problem, ((5, 8), (9, 10), (0, 1)), order)
    assert [[n.name for n in r] for r in got] == [["add", "drop"], ["fc1"]]


def test_ranges_and_runs_round_trip(setup: Setup) -> None:
    problem, by, order = setup
    runs = [[by[m] for m in ("relu", "fc2", "tanh")], [by["drop"]]]
    assert to_runs(problem, to_spans(problem, runs), order) == runs


def test_keep_positions_and_kept_names(setup: Setup) -> None:
    problem, _, _ = setup
    assert keep_positions(problem, ["drop", "tanh"]) == (3, 6, 7)
    assert keep_positions(problem, []) == ()
    assert kept_names(problem, (7, 6, 3)) == ("tanh", "drop")


def test_recomputed_stops_at_the_last_saving_node(setup: Setup) -> None:
    problem, by, _ = setup
    assert problem.early_stop
    runs = [[by[m] for m in ("fc1", "relu", "fc2")],  # fc2 saves only its input relu
            [by["mul"], by["add"]],  # save nothing: nothing runs again
            [by[m] for m in ("tanh", "mul", "add")]]
    got = recomputed(problem, runs)
    assert [[n.name for n in r] for r in got] == [["fc1", "relu"], [], ["tanh"]]

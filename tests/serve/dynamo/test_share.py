"""serve/dynamo/share.py: the FLOPs of one forward counted inside and outside the graphs fxckpt
planned, by torch's own formulas, running every operator as called."""

from __future__ import annotations

import torch

from fxckpt.serve.dynamo.share import Outside, graph_runs

A, B = torch.ones(4, 8), torch.ones(8, 2)
MM = 2 * 4 * 8 * 2  # the FLOPs torch counts for a (4 x 8) @ (8 x 2)


def test_flops_inside_a_planned_graph_and_outside_it_are_counted_apart() -> None:
    with Outside() as mode:
        with graph_runs(mode):
            inside = A @ B
        outside = A @ B
        torch.relu(A)  # no FLOP formula: not counted
    assert torch.equal(inside, outside) and torch.equal(outside, torch.full((4, 2), 8.0))
    assert (mode.planned, mode.unplanned) == (MM, MM)
    assert mode.share == 0.5


def test_nested_graph_runs_stay_planned_and_nothing_counted_has_no_share() -> None:
    mode = Outside()
    assert mode.share is None
    with mode, mode.in_graph(), mode.in_graph():
        A @ B
    assert (mode.planned, mode.unplanned, mode.depth, mode.share) == (MM, 0, 0, 0.0)


def test_without_a_measure_a_graph_run_is_wrapped_in_nothing() -> None:
    with graph_runs(None):
        assert torch.equal(A @ B, torch.full((4, 2), 8.0))
    assert Outside.ignore_compile_internals()

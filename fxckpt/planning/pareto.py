"""The predicted memory / recompute trade-off of a model: one solver plan per budget.

Used by :func:`fxckpt.pareto` and ``fxckpt.plot_pareto``: capture and annotate the model once,
then ask the budget solver for plans from the smallest feasible peak to the eager peak.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from fxckpt.checks import check_model

__all__ = ["pareto"]


def pareto(
    model: torch.nn.Module,
    *,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Optional[Mapping[str, Any]] = None,
    points: int = 9,
    selective: bool = True,
) -> list[dict[str, float]]:
    """The predicted memory / recompute trade-off of ``model`` on these inputs, in its current
    mode.

    Returns points sorted by budget, each ``{"budget": bytes, "predicted_peak": bytes,
    "recompute": fraction of one forward pass's cost, "eager_peak": bytes}``: peaks include the
    reserve and recompute is :func:`fxckpt.cost.prediction.recompute_share`, as in
    ``Plan.predicted_peak`` and ``Plan.recompute_share``. A smaller budget never gives a higher
    predicted peak. With ``selective`` (as ``transform``'s default) each plan may keep costly
    outputs inside its segments (:mod:`fxckpt.solver.selective`).
    """
    check_model(model)
    from fxckpt.cost.annotate import annotate
    from fxckpt.capture.captured import capture
    from fxckpt.cost.prediction import recompute_share
    from fxckpt.cost.bridge import problem_of
    from fxckpt.capture.graphs import planned_nodes
    from fxckpt.planning.keeps import choices
    from fxckpt.solver import pareto as solve_pareto, simulate
    from fxckpt.solver.selective import solve_selective

    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}))
    annotate(captured.gm, captured.graph_args(tuple(example_inputs), dict(example_kwargs or {})))
    problem = problem_of(captured.gm)
    eager = simulate(problem, ()).peak_bytes
    curve = sorted(solve_pareto(problem, points=points), key=lambda p: p.budget)
    offered = choices(problem, planned_nodes(captured.gm.graph), {})[0] if selective else []
    plans = [(recompute_share(problem, p.segments), p.predicted_peak) for p in curve]
    for p in curve if offered else []:
        sel = solve_selective(problem, p.budget, offered)
        plans.append((recompute_share(problem, sel.segments, sel.keep), sel.predicted_peak))
    out = []
    for p in curve:  # the cheapest plan found at any budget that fits this one
        share, peak = min(plan for plan in plans if plan[1] <= p.budget)
        out.append({"budget": p.budget, "predicted_peak": peak,
                    "recompute": share, "eager_peak": eager})
    return out

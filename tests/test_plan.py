"""The Plan prints, renders, serialises and diffs."""

from __future__ import annotations

import json

import pytest
import torch

import fxckpt
from handmade import mlp_plan, pipeline_view
from models import MLP


def test_json_round_trip() -> None:
    plan = mlp_plan(every=2)
    again = fxckpt.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_a_saved_plan_replays_without_solving(monkeypatch) -> None:
    import copy

    from fxckpt.solver import portfolio
    from support import assert_steps_equal, run_step

    x = torch.randn(8, 32, requires_grad=True)
    model = MLP(depth=6)
    reference = copy.deepcopy(model)
    solved = fxckpt.inspect(
        fxckpt.transform(copy.deepcopy(model), budget=0.7, example_inputs=(x,))
    ).plan
    saved = json.loads(json.dumps(solved.to_dict()))

    def no_solving(*args, **kwargs):
        raise AssertionError("replay must not solve")

    monkeypatch.setattr(portfolio, "solve_selective", no_solving)
    monkeypatch.setattr(portfolio, "solve_shared", no_solving)
    tm = fxckpt.transform(model, plan=saved, example_inputs=(x,))
    assert [s.nodes for s in fxckpt.inspect(tm).plan.segments] == [
        s.nodes for s in solved.segments
    ]
    assert (
        fxckpt.inspect(tm).plan.strategy == "replay"
        and fxckpt.inspect(tm).plan.predicted_peak == solved.predicted_peak
    )
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))


def test_replaying_a_plan_for_another_model_is_refused() -> None:
    import pytest

    from models import ResNet

    plan = mlp_plan(every=1)
    tm = fxckpt.transform(ResNet(), plan=plan)
    with pytest.raises(
        fxckpt.PlanError, match="names node 'layers_0_fc', which this model's graph does not have"
    ):
        tm(torch.randn(2, 3, 8, 8))
    with pytest.raises(
        fxckpt.ConfigError, match="give at most one strategy, got every=1 and plan=<Plan>"
    ):
        fxckpt.transform(MLP(), every=1, plan=plan)
    with pytest.raises(
        fxckpt.ConfigError, match=r"plan must be a fxckpt.Plan or its to_dict\(\) \(got str\)"
    ):
        fxckpt.transform(MLP(), plan="plan.json")


def test_pipeline_view_round_trips_and_reads_plans_saved_without_stop() -> None:
    from fxckpt.plan import PipelineView

    view = pipeline_view()
    saved = json.loads(json.dumps(view.to_dict()))
    assert saved["bubble"] == 0.2 and saved["schedule"] == view.schedule and saved["stop"] == 3
    assert PipelineView.from_dict(saved, training=True) == view
    del saved["stop"]  # as fxckpt wrote plans before the view was typed
    assert PipelineView.from_dict(saved, training=True).stop == 3  # except_last of 4
    assert PipelineView.from_dict(saved, training=False).stop == 0
    saved["checkpoint"] = "always"
    assert PipelineView.from_dict(saved, training=True).stop == 4


@pytest.mark.parametrize("p,held", [(0.1, 5), (0.0, 3)])
def test_frees_is_what_the_step_stops_holding_between_forward_and_backward(
    p: float, held: int
) -> None:
    """MLP blocks are fc -> GELU -> dropout. Each holds until backward the fc output (GELU saves
    it), and with p > 0 the dropout mask and output (the next fc saves it); with p = 0 dropout is
    the identity and the next fc saves the GELU output. A segment of two blocks frees all of
    those 16x32 float tensors but its output, which the next segment keeps as its input."""
    from fxckpt.cost.bridge import to_problem
    from fxckpt.cost.runs import spans_of
    from fxckpt.solver import simulate

    tm = fxckpt.transform(MLP(depth=6, p=p), every=2, example_inputs=(torch.randn(16, 32),))
    seen = fxckpt.inspect(tm)
    plan = seen.plan
    assert [s.freed_bytes for s in plan.segments] == [held * 16 * 32 * 4] * 3
    assert plan.freed_bytes == 3 * held * 16 * 32 * 4
    problem = to_problem(seen.view)
    ranges = spans_of(problem, [s.nodes for s in plan.segments])
    start = [dict(simulate(problem, r).timeline)["backward start"] for r in ((), ranges)]
    assert start[0] - start[1] == plan.freed_bytes  # the inputs kept are held eagerly anyway
    assert plan.eager_peak and plan.predicted_peak
    assert 0 < plan.eager_peak - plan.predicted_peak <= plan.freed_bytes  # recompute needs room


def test_no_strategy_with_chunks_says_the_pipeline_still_recomputes() -> None:
    tm = fxckpt.transform(MLP(depth=4), chunks=2, devices=["cpu", "cpu"],
                          example_inputs=(torch.randn(8, 32),))
    assert fxckpt.inspect(tm).plan.notes == (
        "no segment is checkpointed within a micro-batch: no strategy was given; the pipeline "
        "still recomputes each stage of the micro-batches checkpoint='except_last' names",)
    plain = fxckpt.transform(MLP(depth=4), example_inputs=(torch.randn(8, 32),))
    assert fxckpt.inspect(plain).plan.notes == ("nothing is checkpointed: no strategy was given",)


def test_the_old_name_of_a_plan_segment_still_resolves_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="fxckpt.Segment is now fxckpt.SegmentSpec"):
        assert fxckpt.Segment is fxckpt.SegmentSpec


@pytest.mark.parametrize("options", [{"every": 1}, {"depth": 2}, {"budget": 0.7},
                                     {"budget": 0.8}])
def test_every_plan_states_a_floor_no_plan_at_its_peak_goes_under(options: dict) -> None:
    """Whatever strategy made it, a plan carries the recompute floor at its predicted peak
    (:mod:`fxckpt.solver.floor`), its gap to it, and says both in its summary."""
    plan = mlp_plan(**options)
    assert plan.recompute_share is not None and plan.recompute_floor is not None
    assert 0 < plan.recompute_floor <= plan.recompute_share
    assert plan.gap == pytest.approx(1 - plan.recompute_floor / plan.recompute_share)
    assert (f"(any plan at this peak: at least {plan.recompute_floor:.0%})"
            in plan.summary())
    again = fxckpt.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.recompute_floor == plan.recompute_floor


def test_a_plan_saved_before_floors_loads_without_one() -> None:
    d = mlp_plan(every=2).to_dict()
    del d["recompute_floor"]
    old = fxckpt.Plan.from_dict(d)
    assert old.recompute_floor is None and old.gap is None
    assert "any plan at this peak" not in old.summary()


def test_budget_bytes_names_the_bytes_and_the_old_name_still_reads_with_a_warning() -> None:
    """A budget is what the user writes (``0.7``); the plan's figure is ``budget_bytes``."""
    plan = mlp_plan(budget=0.7)
    assert plan.budget_bytes == int(0.7 * plan.eager_peak_bytes)
    with pytest.warns(DeprecationWarning, match="use Plan.budget_bytes"):
        assert plan.budget == plan.budget_bytes
    old = plan.to_dict()
    old["budget"] = old.pop("budget_bytes")  # a plan saved before the rename
    assert fxckpt.Plan.from_dict(old) == plan

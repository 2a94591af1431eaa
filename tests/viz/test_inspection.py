"""viz/inspection.py: ``fxckpt.inspect``, fxckpt's view of a transformed (or loaded) module: its
options, plans, code and counts, and what it says before anything was planned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.errors import ConfigError, NotPlannedError
from fxckpt.viz.inspection import Inspection, LoadedInspection, inspect
from handmade import Tiny


def test_before_any_plan_the_view_says_how_to_get_one() -> None:
    model = Tiny()
    info = inspect(fxckpt.transform(model, every=1))
    assert isinstance(info, Inspection) and info.model is model
    assert info.config.strategy_name == "every"
    assert (info.plans, info.captures, info.plans_made, info.graphs) == ([], 0, 0, [])
    assert repr(info) == "<fxckpt.inspect of Tiny: not planned yet>"
    with pytest.raises(NotPlannedError, match="^this module has not planned yet, so there is no "
                                              "plan to inspect: it plans at its first training "
                                              "call"):
        info.plan


def test_plan_for_plans_without_a_step_and_the_views_follow() -> None:
    tm = fxckpt.transform(Tiny(), every=1, capture="graph")
    info = inspect(tm)
    plan = info.plan_for(torch.randn(3, 4))
    assert info.plan is plan and info.plans == [plan]
    assert (info.captures, info.plans_made) == (1, 1)
    assert info.planning_seconds > 0
    assert "fxckpt_checkpoint(segment_0" in info.code and info.code == info.graph_module.code
    assert info.pipeline is None and info.offload_stats is None and info.unplanned_share is None
    assert info.view is info.view  # the graph view is made once per plan
    in_view = {n: d["segment"] for n, d in info.view.nodes(data=True) if d["segment"]}
    assert in_view == {n: s.name for s in plan.segments for n in s.nodes}
    assert repr(info) == f"<fxckpt.inspect of Tiny: {plan.summary()}>"


def test_a_model_that_was_not_transformed_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^fxckpt.inspect takes a module fxckpt.transform "
                                          r"returned \(got Tiny\)"):
        inspect(Tiny())


def test_a_loaded_module_has_the_same_view_of_its_saved_graph(tmp_path: Path) -> None:
    tm = fxckpt.transform(Tiny(), every=1, capture="graph", example_inputs=(torch.randn(3, 4),))
    fxckpt.save(tm, tmp_path / "tiny")
    loaded = fxckpt.load(tmp_path / "tiny")
    info = inspect(loaded)
    assert isinstance(info, LoadedInspection)
    assert info.plan == inspect(tm).plan and info.plans == [info.plan]
    assert info.code == loaded.code and info.graph_module is loaded.graph_module
    assert info.pipeline is None and len(info.view) == len(inspect(tm).view)

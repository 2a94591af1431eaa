"""The Plan prints, renders, serialises and diffs."""

from __future__ import annotations

import json

import torch

import fxckpt
from models import MLP


def _plan(**options) -> fxckpt.Plan:
    return fxckpt.inspect(fxckpt.transform(MLP(depth=4), **options, example_inputs=(torch.randn(4, 32),))).plan


def test_text_table_has_a_row_per_segment_in_human_units() -> None:
    plan = _plan(depth=2)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == plan.summary()
    assert lines[1].split()[:4] == ["segment", "modules", "nodes", "keeps"]
    assert [l.split()[0] for l in lines[2:]] == ["segment_0", "segment_1", "segment_2", "segment_3"]
    assert "512 B" in lines[2] and "layers.0" in lines[2]


def test_html_has_a_row_per_segment() -> None:
    plan = _plan(every=1)
    html = plan._repr_html_()
    assert html.count("<tr>") == len(plan.segments) + 1 and "fxckpt plan" in html


def test_json_round_trip() -> None:
    plan = _plan(every=2)
    again = fxckpt.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_diff_names_what_changed() -> None:
    a, b = _plan(every=1), _plan(every=2)
    text = a.diff(b)
    assert "- segment_0" in text and "+ segment_0" in text
    assert f"segments: {len(a.segments)} -> {len(b.segments)}" in text
    assert a.diff(a) == "the plans are the same"


def test_a_saved_plan_replays_without_solving(monkeypatch) -> None:
    import copy

    from fxckpt.passes import strategies
    from support import assert_steps_equal, run_step

    x = torch.randn(8, 32, requires_grad=True)
    model = MLP(depth=6)
    reference = copy.deepcopy(model)
    solved = fxckpt.inspect(fxckpt.transform(copy.deepcopy(model), budget=0.5, example_inputs=(x,))).plan
    saved = json.loads(json.dumps(solved.to_dict()))

    def no_solving(*args, **kwargs):
        raise AssertionError("replay must not solve")

    monkeypatch.setattr(strategies, "solve", no_solving)
    tm = fxckpt.transform(model, plan=saved, example_inputs=(x,))
    assert [s.nodes for s in fxckpt.inspect(tm).plan.segments] == [s.nodes for s in solved.segments]
    assert fxckpt.inspect(tm).plan.strategy == "replay" and fxckpt.inspect(tm).plan.predicted_peak == solved.predicted_peak
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))


def test_replaying_a_plan_for_another_model_is_refused() -> None:
    import pytest

    from models import ResNet

    plan = _plan(every=1)
    tm = fxckpt.transform(ResNet(), plan=plan)
    with pytest.raises(fxckpt.PlanError, match="names node 'layers_0_fc', which this model's graph does not have"):
        tm(torch.randn(2, 3, 8, 8))
    with pytest.raises(fxckpt.ConfigError, match="give at most one strategy, got every=1 and plan=<Plan>"):
        fxckpt.transform(MLP(), every=1, plan=plan)
    with pytest.raises(fxckpt.ConfigError, match=r"plan must be a fxckpt.Plan or its to_dict\(\) \(got str\)"):
        fxckpt.transform(MLP(), plan="plan.json")

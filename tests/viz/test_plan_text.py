"""The views of a plan built in fxckpt.viz.plan_text: the summary line, the segment table as text
and HTML, the diff, and the pipeline's stages and schedule."""

from __future__ import annotations

import json

import torch

import fxckpt
from handmade import mlp_plan, pipeline_view
from models import MLP


def test_text_table_has_a_row_per_segment_in_human_units() -> None:
    plan = mlp_plan(depth=2)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == plan.summary()
    assert lines[1].split()[:5] == ["segment", "modules", "nodes", "saved", "inputs"]
    assert [l.split()[0] for l in lines[2:]] == [
        "segment_0",
        "segment_1",
        "segment_2",
        "segment_3",
    ]
    assert "512 B" in lines[2] and "layers.0" in lines[2]


def test_html_has_a_row_per_segment() -> None:
    plan = mlp_plan(every=1)
    html = plan._repr_html_()
    assert html.count("<tr>") == len(plan.segments) + 1 and "fxckpt plan" in html


def test_diff_names_what_changed() -> None:
    a, b = mlp_plan(every=1), mlp_plan(every=2)
    text = a.diff(b)
    assert "- segment_0" in text and "+ segment_0" in text
    assert f"segments: {len(a.segments)} -> {len(b.segments)}" in text
    assert a.diff(a) == "the plans are the same"


def test_pipeline_view_derives_devices_bubble_and_schedule_from_its_fields() -> None:
    from fxckpt.runtime.schedule import schedule_chart

    view = pipeline_view()
    assert view.devices == ("cpu", "cuda:1") and view.bubble == 1 / 5
    assert view.schedule == schedule_chart(4, 2, recompute_stop=3)
    assert view.lines()[:4] == [
        "pipeline: 2 stage(s), chunks=4, checkpoint=except_last, bubble 20% (balanced)",
        "stage  device  nodes  cost   modules",
        "0      cpu     3      1,234  layers.0",
        "1      cuda:1  2      99     layers.1, head",
    ]
    assert view.lines()[4] == view.schedule and str(view) == "\n".join(view.lines())


def test_a_pipelined_plan_prints_its_view_after_the_segments() -> None:
    x = torch.randn(8, 32)
    tm = fxckpt.transform(MLP(depth=4), every=2, chunks=2, devices=["cpu", "cpu"],
                          example_inputs=(x,))
    info = fxckpt.inspect(tm)
    view = info.plan.pipeline
    assert view is not None and view.chunks == 2 and view.checkpoint == "except_last"
    assert (view.stop, view.devices, view.cost) == (1, ("cpu", "cpu"), "flops")
    assert [s.stage for s in view.stages] == [0, 1]
    assert sum(s.nodes for s in view.stages) == info.plan.node_count  # segments count their nodes
    assert str(info.plan).endswith("\n\n" + str(view))
    assert info.pipeline.describe() == str(view)  # the module's description is the same text
    assert fxckpt.Plan.from_dict(json.loads(json.dumps(info.plan.to_dict()))) == info.plan


def test_every_view_shows_the_plans_own_figures() -> None:
    import dataclasses

    from fxckpt.plan import format_bytes

    plan = mlp_plan(every=2, verify=False)  # the simulator's figures (verified ones: below)
    assert plan.peak_bytes == plan.predicted_peak and plan.recompute_share is not None
    share = f"recompute ~{plan.recompute_share:.0%} of a forward pass"
    peak = (f"predicted peak {format_bytes(plan.peak_bytes)} ("
            f"{plan.peak_bytes / plan.eager_peak_bytes:.0%} of "
            f"{format_bytes(plan.eager_peak_bytes)} eager)")
    for text in (plan.summary(), str(plan), plan._repr_html_()):
        assert share in text and peak in text and f"frees {format_bytes(plan.freed_bytes)}" in text
    verified = dataclasses.replace(plan, verified_peak=1000, verified_eager_peak=4000)
    assert "verified peak 1000 B (25% of 3.9 KiB eager)" in verified.summary()
    assert "peak: " in plan.diff(verified) and "-> 1000 B" in plan.diff(verified)


def test_a_pipelined_plan_says_its_peak_and_budget_are_per_micro_batch() -> None:
    x = torch.randn(8, 32)
    tm = fxckpt.transform(MLP(depth=4), budget="1MiB", chunks=2, devices=["cpu", "cpu"],
                          example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert plan.micro_batched and plan.pipeline is not None
    summary = plan.summary()
    assert "peak" in summary and summary.count("per micro-batch") == 2
    assert "under a budget of 1.0 MiB per micro-batch" in summary
    assert any("the budget bounds one micro-batch's step (chunks=2)" in n for n in plan.notes)
    html = plan._repr_html_()
    assert plan.pipeline.schedule.splitlines()[0] in html
    for stage in plan.pipeline.stages:  # the stage table, modules from the stage plan
        assert f"<td>{', '.join(stage.modules)}</td>" in html
    assert html.count("<table>") == 2

"""The Plan prints, renders, serialises and diffs."""

from __future__ import annotations

import json

import torch

import fxckpt
from models import MLP


def _plan(**options) -> fxckpt.Plan:
    return fxckpt.transform(MLP(depth=4), **options, example_inputs=(torch.randn(4, 32),)).plan


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

"""viz/report.py: a plan report on disk (table, JSON, code, pictures, one HTML page), written
without pictures when matplotlib is missing, and saying so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.viz.report import Progress, write_report
from handmade import Tiny

X = torch.randn(3, 4)


@pytest.fixture
def tm() -> fxckpt.TransformedModule:
    return fxckpt.transform(Tiny(), every=1, capture="graph", example_inputs=(X,))


def test_without_matplotlib_the_report_has_everything_but_pictures(
        tm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    index = write_report(tm, tm, (X,), tmp_path / "out")
    plan = fxckpt.inspect(tm).plan
    assert index == tmp_path / "out" / "index.html"
    assert sorted(p.name for p in index.parent.iterdir()) == ["code.py", "index.html",
                                                              "plan.json", "plan.txt"]
    assert json.loads((index.parent / "plan.json").read_text()) == plan.to_dict()
    assert (index.parent / "plan.txt").read_text() == str(plan) + "\n"
    assert (index.parent / "code.py").read_text() == fxckpt.inspect(tm).code
    page = index.read_text()
    assert "<p><i>Pictures skipped: " in page and "pip install" in page
    assert "fxckpt_checkpoint(segment_0, x)" in page and "<img" not in page


@pytest.mark.slow  # draws and writes two pictures, measuring a step: about 0.7 s
def test_with_matplotlib_the_graph_and_memory_pictures_are_on_the_page(tm,
                                                                       tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    index = write_report(tm, tm, (X,), tmp_path, pareto=False)
    assert {"graph.png", "memory.png"} <= {p.name for p in tmp_path.iterdir()}
    assert "pareto.png" not in {p.name for p in tmp_path.iterdir()}
    page = index.read_text()
    assert '<img src="graph.png" alt="graph.png">' in page and "Pictures skipped" not in page


def test_progress_is_nothing_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with Progress(total=2, desc="pictures") as progress:
        progress.step("graph.png")
    assert progress.bar is None

"""The Pareto pictures: the points each model's picture shows, the PNG, the report's links."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.plot import Point, pareto_data, plot_model, write_plots
from benchmarks.report import render_markdown, write_report

MiB = 2**20


def _row(model: str, method: str, label: str, rss: float | None, ratio: float | None,
         status: str = "ok") -> dict[str, Any]:
    return {"model": model, "method": method, "budget": None, "label": label, "status": status,
            "rss_bytes": None if rss is None else int(rss * MiB), "time_ratio": ratio}


ROWS = [
    _row("m", "unmodified", "unmodified", 100, 1.0),
    _row("m", "fxckpt", "fxckpt b=0.5", 50, 1.10),
    _row("m", "fxckpt", "fxckpt b=0.25", 25, 1.30),
    _row("m", "fxckpt", "fxckpt @sac_ops", 60, 1.04),
    _row("m", "fxckpt_compiled", "fxckpt_compiled @compile b=0.5", 40, 1.01),
    _row("m", "fxckpt", "fxckpt b=0.1", None, None, status="infeasible"),
    _row("m", "sac_ops", "sac_ops", 62, 1.08),
    _row("m", "checkpoint_per_block", "checkpoint_per_block", 30, 1.35),
    _row("m", "compile", "compile b=0.5", 55, 1.2),
    _row("m", "compile", "compile b=0.75", 70, None),  # not timed: not a point
    _row("m", "sac_megatron", "sac_megatron", None, None, status="n/a"),
    _row("other", "fxckpt", "fxckpt b=0.5", 5, 1.5),
]


def test_pareto_data_keeps_measured_points_fxckpt_in_memory_order_peers_by_method() -> None:
    data = pareto_data(ROWS, "m")
    assert data.fxckpt == (Point("fxckpt b=0.25", 25 * MiB, 1.30),
                           Point("fxckpt b=0.5", 50 * MiB, 1.10),
                           Point("fxckpt @sac_ops", 60 * MiB, 1.04))
    per_block = Point("checkpoint_per_block", 30 * MiB, 1.35)
    assert data.peers == (("checkpoint_per_block", (per_block,)),
                          ("sac_ops", (Point("sac_ops", 62 * MiB, 1.08),)),
                          ("compile", (Point("compile b=0.5", 55 * MiB, 1.2),)))
    assert data.unmodified == Point("unmodified", 100 * MiB, 1.0)
    # compiled plans are fxckpt's points, but not on the eager line
    assert data.compiled == (Point("fxckpt_compiled @compile b=0.5", 40 * MiB, 1.01),)
    assert pareto_data(ROWS, "other").peers == () and pareto_data(ROWS, "other").unmodified is None


def test_plot_model_draws_those_points_and_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    fig = plot_model(pareto_data(ROWS, "m"), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    (line,) = ax.lines
    assert line.get_gid() == "fxckpt"
    assert line.get_xydata().tolist() == [[25.0, 1.3], [50.0, 1.1], [60.0, 1.04]]  # MiB
    marks = {c.get_gid(): c.get_offsets().tolist() for c in ax.collections}
    assert marks == {"checkpoint_per_block": [[30.0, 1.35]], "sac_ops": [[62.0, 1.08]],
                     "compile": [[55.0, 1.2]], "unmodified": [[100.0, 1.0]],
                     "fxckpt_compiled": [[40.0, 1.01]]}
    assert "MiB" in ax.get_xlabel() and "unmodified" in ax.get_ylabel()


def test_the_report_writes_one_picture_per_model_and_links_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert write_plots(ROWS, tmp_path) == {"m": "pareto_m.png", "other": "pareto_other.png"}
    result = {"rows": [dict(r, model="gpt2") for r in ROWS[:9]], "scaling": [],
              "seconds": 60.0, "options": {"repeats": 1, "quick": True},
              "machine": {"cores": 2, "cpu": "cpu", "torch": "t", "transformers": "x",
                          "python": "3", "threads": 1, "load_average": [0.5], "commit": "c"}}
    md_path, js_path = write_report(result, [], tmp_path / "docs")
    md = md_path.read_text()
    assert "![gpt2: measured peak memory against step time, every method](pareto_gpt2.png)" in md
    assert (tmp_path / "docs" / "pareto_gpt2.png").stat().st_size > 0
    assert '"plots": {\n  "gpt2": "pareto_gpt2.png"' in js_path.read_text()
    assert "](pareto_" not in render_markdown(result, [])  # no pictures written, no links

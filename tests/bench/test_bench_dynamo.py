"""The Dynamo bench (benchmarks/dynamo.py): what it measures and how it judges."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import dynamo


def test_the_targets_are_a_first_call_ratio_and_a_step_ratio() -> None:
    assert dynamo.passes({"first_ratio": 1.5, "overhead": 1.02}) == (True, True)
    assert dynamo.passes({"first_ratio": 1.51, "overhead": 1.021}) == (False, False)


@pytest.mark.slow
def test_quick_run_measures_every_column_and_writes_the_page(tmp_path: Path) -> None:
    argv = ["--quick", "--models", "mlp", "--repeats", "1", "--turns", "6", "--out",
            str(tmp_path)]
    assert dynamo.main(argv) == 0
    rows = [line for line in (tmp_path / "dynamo.md").read_text().splitlines()
            if line.startswith("| mlp")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    first, eager, planning = (float(c.removesuffix(" s")) for c in cells[1:4])
    assert first > 0 and eager > 0 and planning > 0
    # the cells are rounded to 0.01 s: on the quick model's sub-second times that moves the ratio
    assert float(cells[4]) == pytest.approx(first / (eager + planning), rel=0.05)
    assert cells[5] in ("PASS", "FAIL") and cells[8] in ("PASS", "FAIL")
    assert len(cells) == 11
    assert all(0.5 < float(cells[i]) < 3 for i in (7, 9, 10))  # paired ratios
    long = [line for line in (tmp_path / "dynamo.md").read_text().splitlines()
            if line.startswith("| llama (")]
    assert len(long) == 1 and "seq=256" in long[0]  # the long-sequence row, at its quick size
    cells = [c.strip() for c in long[0].strip("|").split("|")]
    assert float(cells[1].removesuffix(" ms")) > 0 and cells[3] in ("PASS", "FAIL")
    assert all(0.5 < float(cells[i]) < 3 for i in (2, 4, 5))


def test_the_long_sequence_row_renders_under_its_own_heading() -> None:
    row = {"model": "llama (seq=2048)", "step_s": 0.7, "overhead": 1.03, "guards": 1.0,
           "compile_overhead": 1.4}
    text = dynamo.render({"repeats": 1, "turns": 2, "rows": [], "long": row, "budget": 0.5},
                         {"cpu": "x", "cores": 2, "torch": "t", "transformers": "t",
                          "commit": "c"})
    assert "## A long sequence" in text
    assert "| llama (seq=2048) | 700.0 ms | 1.030 | FAIL | 1.000 | 1.400 |" in text

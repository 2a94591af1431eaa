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
    argv = ["--quick", "--models", "mlp", "--repeats", "1", "--turns", "2", "--out",
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

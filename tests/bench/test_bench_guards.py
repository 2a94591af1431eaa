"""The guard-overhead bench (benchmarks/guards.py): what it measures and how it judges."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import guards


def test_the_target_is_a_share_of_the_step_or_a_few_microseconds() -> None:
    row = {"fraction": 0.03, "check_s": 15e-6}
    assert guards.passes(row)  # over 2% of a (tiny) step, but under 20 us
    assert guards.passes({"fraction": 0.01, "check_s": 80e-6})
    assert not guards.passes({"fraction": 0.03, "check_s": 80e-6})


@pytest.mark.slow
def test_quick_run_times_both_copies_and_writes_the_page(tmp_path: Path) -> None:
    assert guards.main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "guards.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| depth", "| budget"))]
    assert len(rows) == len(guards.STRATEGIES)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[1]) > 10 and int(cells[2]) > int(cells[1])  # modules, guarded dicts
        assert cells[3].endswith(" us") and float(cells[3][:-3]) > 0
        assert cells[-1] in ("PASS", "FAIL")

"""The CPU step-time check (benchmarks/step_time.py): predicted steps from the plans' own
figures, measured steps paired by turns."""

from __future__ import annotations

import pytest

from benchmarks import step_time
from fxckpt.cost.bridge import SEGMENT_COST
from fxckpt.cost.devices import cpu_profile


@pytest.mark.slow
def test_each_plan_predicts_its_step_from_its_recompute_share_and_segments() -> None:
    rows = step_time.measure("mlp", quick=True, turns=2, rate=1e10)
    by = {r.method: r for r in rows}
    assert list(by) == ["unmodified", "fxckpt 0.5", "fxckpt 0.75"]
    base = by["unmodified"]
    assert base.segments == 0 and base.recompute_share == 0.0
    forward = base.forward_s  # seconds of one forward at the rate given
    assert forward > 0 and base.backward_s > 0  # the backward priced call by call
    assert base.predicted_s == pytest.approx(forward + base.backward_s)
    for r in rows:
        assert r.measured_s > 0 and r.ratio == r.predicted_s / r.measured_s
        assert (r.forward_s, r.backward_s) == (forward, base.backward_s)
        assert r.table_s is None  # the tests price with the table: nothing to compare
    half = by["fxckpt 0.5"]
    assert half.segments > 0 and half.recompute_share > 0
    for r in (half, by["fxckpt 0.75"]):  # the recompute, and each segment's fixed price
        assert r.predicted_s - base.predicted_s == pytest.approx(
            r.recompute_share * forward + r.segments * SEGMENT_COST / 1e10)
    text = step_time.render(rows, {"seconds": 1.0, "rate": 1e10, "turns": 2, "threads": 1,
                                   "torch": "x", "machine": "here"})
    assert text.count("\n| mlp |") == 3 and "of 3 predicted steps are within 10%" in text
    assert "table's" not in text  # no comparison with the table when it priced the plans


@pytest.mark.slow
def test_plans_priced_here_are_timed_against_the_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "measured")
    rows = step_time.measure("mlp", quick=True, turns=2)
    planned = [r for r in rows if r.method != "unmodified"]
    assert all(r.table_s is not None and r.table_s > 0 for r in planned)
    assert all(isinstance(r.table_same, bool) and r.table_segments is not None for r in planned)
    text = step_time.render(rows, {"seconds": 1.0, "rate": 1e10, "turns": 2, "threads": 1,
                                   "torch": "x", "machine": "here"})
    assert "## This machine's prices against the table's" in text
    assert text.count("\n| mlp | 0.") == 2


@pytest.mark.slow
def test_the_prediction_after_refinement_prices_the_ops_at_the_measured_factor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured prices: each module refines before the turns, and the second prediction puts
    the model's ops at the factor its segments measured."""
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "measured")
    rows = step_time.measure("mlp", quick=True, turns=2, rate=1e10)
    planned = [r for r in rows if r.method != "unmodified"]
    assert all(isinstance(r.replanned, bool) for r in planned)
    assert rows[0].replanned is None
    overhead = cpu_profile().segment * cpu_profile().unit / 1e10  # seconds at the rate given
    factors = [(r.refined_s - r.segments * overhead) / (r.predicted_s - r.segments * overhead)
               for r in rows if r.refined_s is not None]
    assert len(factors) == 3 and max(factors) == pytest.approx(min(factors))  # one per model
    text = step_time.render(rows, {"seconds": 1.0, "rate": 1e10, "turns": 2, "threads": 1,
                                   "torch": "x", "machine": "here"})
    assert "## After the first steps refined the prices" in text
    assert "within 10% after refinement" in text
    # each row predicted from another module's timed steps: what its own plan adds on top
    by = {r.method: r for r in rows}
    assert all(r.stepped_s and r.stepped_factor_s for r in rows)
    segment = cpu_profile().segment
    three = by["fxckpt 0.75"]  # predicted from the 0.5 module's steps, as the unmodified step
    assert (three.stepped_s or 0) - (by["unmodified"].stepped_s or 0) >= \
        three.segments * segment * (1 - 1e-9)
    assert "## From another plan's first steps" in text and "at the measured factor, " in text
    assert "| mlp | unmodified | fxckpt 0.5 |" in text
    assert "| mlp | fxckpt 0.5 | fxckpt 0.75 |" in text

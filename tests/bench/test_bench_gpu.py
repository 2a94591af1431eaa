"""The GPU bench's judgement (benchmarks/gpu.py) and the CPU-side predictions
(benchmarks/predict.py)."""

from __future__ import annotations

import pytest

from benchmarks import gpu, predict
from fxckpt.cost.devices import PROFILES

MiB = 2**20


def _rows() -> list[gpu.Row]:
    return [
        gpu.Row("llama", "unmodified", peak_bytes=1000 * MiB, seconds=1.0, unmodified_seconds=1.0),
        gpu.Row("llama", "checkpoint_per_block", peak_bytes=200 * MiB, seconds=1.3,
                unmodified_seconds=1.0),
        gpu.Row("llama", "fxckpt", budget=0.5, budget_bytes=500 * MiB, peak_bytes=505 * MiB,
                stated_bytes=500 * MiB, seconds=1.04, unmodified_seconds=1.0),
        gpu.Row("llama", "fxckpt @checkpoint_per_block", budget=200 * MiB,
                budget_bytes=200 * MiB, peak_bytes=230 * MiB, stated_bytes=200 * MiB,
                seconds=1.2, unmodified_seconds=1.0),
        gpu.Row("llama", "fxckpt_offload", peak_bytes=300 * MiB, seconds=1.05,
                unmodified_seconds=1.0, copy_seconds=0.5),
        gpu.Row("llama", "sac_ops", error="RuntimeError: out of memory"),
    ]


def test_targets_judge_each_row_with_its_numbers() -> None:
    checks = {c.name: c for c in gpu.targets(_rows())}
    assert checks["budget held: llama fxckpt b=0.5"].passed  # 505 <= 1.02 x 500
    assert not checks["budget held: llama fxckpt @checkpoint_per_block b=209715200"].passed
    assert not checks["plan peak within 5%: llama fxckpt @checkpoint_per_block"].passed  # -13%
    faster = checks["faster at the peer's memory: llama fxckpt @checkpoint_per_block"]
    assert not faster.passed and "time 0.923x the peer's, memory 1.150x" in faster.detail
    assert checks["llama at 0.5 within 1.05x unmodified time"].passed
    hidden = checks["offload hides 80% of its copies: llama"]
    assert hidden.passed and "90% of 500.0 ms hidden" in hidden.detail
    assert not any("sac_ops" in name for name in checks)  # an error row is judged by nothing


@pytest.mark.parametrize("predicted,passed", [(0.91, True), (1.09, True), (0.89, False),
                                              (1.12, False), (None, None)])
def test_the_unmodified_step_predicted_from_a_plan_s_first_steps_is_judged(
        predicted: float, passed: bool) -> None:
    rows = _rows()
    rows[2].predicted_unmodified = predicted  # fxckpt at 0.5; the unmodified step took 1 s
    checks = {c.name: c for c in gpu.targets(rows)}
    name = "unmodified step predicted within 10%: llama fxckpt b=0.5"
    if passed is None:  # not refined: nothing to judge
        assert name not in checks
        return
    assert checks[name].passed is passed
    assert checks[name].detail == (f"{predicted * 1e3:.1f} ms from the plan's first steps vs "
                                   f"1000.0 ms ({predicted - 1:+.1%})")


@pytest.mark.parametrize("seconds,passed", [(1.06, True), (1.07, False)])
def test_offload_auto_is_judged_against_recompute_at_the_same_budget(seconds: float,
                                                                     passed: bool) -> None:
    rows = _rows() + [gpu.Row("llama", "fxckpt_offload_auto", budget=0.5,
                              budget_bytes=500 * MiB, peak_bytes=490 * MiB,
                              stated_bytes=495 * MiB, seconds=seconds, unmodified_seconds=1.0)]
    checks = {c.name: c for c in gpu.targets(rows)}
    same = checks["offload='auto' no slower than recompute: llama b=0.5"]
    assert same.passed is passed  # within 2% of fxckpt at 0.5's 1.04x
    assert same.detail == f"{seconds:.3f}x unmodified against 1.040x"
    assert checks["budget held: llama fxckpt_offload_auto b=0.5"].passed
    assert not checks["llama at 0.5 within 1.05x unmodified time (fxckpt_offload_auto)"].passed
    assert checks["llama at 0.5 within 1.05x unmodified time"].passed  # the row without offload


def test_the_report_shows_errors_and_the_summary_counts() -> None:
    rows = _rows()
    checks = gpu.targets(rows)
    text = gpu.render(rows, checks, "cpu", {"cpu": "x", "cores": 2, "torch": "t",
                                              "transformers": "t", "commit": "c"})
    assert "| llama | sac_ops | — | RuntimeError: out of memory |" in text
    assert gpu.summary(rows, checks, 12.0).startswith(
        "gpu bench: 6 rows, 1 errors, targets 4 PASS / 3 FAIL")


@pytest.mark.slow
def test_predictions_on_meta_are_deterministic_and_priced_for_the_profile() -> None:
    rows, facts = predict.predict("h100", layers=2, seq=256)
    again, _ = predict.predict("h100", layers=2, seq=256)
    assert [(r.method, r.peak_bytes, r.step_seconds) for r in rows] == \
        [(r.method, r.peak_bytes, r.step_seconds) for r in again]
    by = {r.method: r for r in rows}
    assert list(by)[:6] == ["unmodified", "per-block", "op policy", "Megatron selective",
                            "fxckpt 0.5", "fxckpt 0.5 + offload"]
    assert by["per-block"].peak_bytes < by["unmodified"].peak_bytes
    assert by["op policy"].kept > 0 and by["per-block"].kept == 0
    assert by["per-block"].step_seconds > by["unmodified"].step_seconds > 0
    assert facts["forward_seconds"] > 0
    # a step is the unmodified step, the plan's recompute (kept nodes' bookkeeping included,
    # counted once) and the segments' overhead
    profile = PROFILES["h100"]
    assert profile is not None
    for r in rows[1:]:
        extra = r.step_seconds - by["unmodified"].step_seconds - r.segments * profile.segment
        assert extra == pytest.approx(r.recompute_share * facts["forward_seconds"])
    policy = by["op policy"]
    assert policy.recompute_share * facts["forward_seconds"] > policy.kept * profile.keep
    assert "| unmodified | 0 | 0 |" in predict.render(rows, facts)
    # every plan's floor lies under its recompute, and no step under the floor's (a plan that
    # may move bytes for free has a floor that may be 0)
    for r in rows[1:]:
        assert 0 <= r.floor <= r.recompute_share and r.floor_step <= r.step_seconds
        assert r.floor > 0 or r.method.endswith("+ offload")
    # offloading beside the compute only takes from the recompute at the same budget: the plan
    # without offload is one of those it searched
    offload = by["fxckpt 0.5 + offload"]
    assert offload.note.startswith("offload='auto' with copies beside the compute")
    assert offload.recompute_share <= by["fxckpt 0.5"].recompute_share
    assert offload.peak_bytes <= by["fxckpt 0.5"].peak_bytes * 1.01  # the same budget
    assert all(not r.note and not r.offloaded for r in rows if r is not offload)


@pytest.mark.slow
def test_the_search_is_checked_against_the_exact_optimum_and_the_floor() -> None:
    e = predict.exact_check("h100", layers=2, fraction=0.85, seq=256)
    assert (e.layers, e.fraction) == (2, 0.85) and e.ops > 100 and e.eager_bytes > 0
    assert e.optimum is not None and e.search_segments > 0
    # the floor bounds every plan; the search is within the solver bench's 2% of the optimum
    # of segments alone (it may beat it: it also keeps outputs)
    assert 0 < e.floor <= min(e.search, e.optimum)
    assert e.search <= 1.02 * e.optimum
    page = predict.render_exact(e, {"profile": "h100", "model": "llama3-8b"})
    assert "#### Against the exact optimum: 2 layers at 0.85" in page
    assert f"| fxckpt's search | {e.search:.1%} | {e.search_segments} segments, " in page
    assert f"| exact optimum of segments alone | {e.optimum:.1%} |" in page
    assert f"| floor | {e.floor:.1%} |" in page

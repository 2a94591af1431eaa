"""Issue 13's targets: speed at each peer's peak (GPT-2, BERT, Llama) and Llama at 0.66."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.runner import BenchOptions, configurations, matched_configs
from benchmarks.targets import check_targets

MiB = 2**20


def _row(model: str, method: str, budget: Any, rss: float, ratio: float, **extra: Any
         ) -> dict[str, Any]:
    label = extra.pop("label", method if budget is None else f"{method} b={budget:g}")
    return {"model": model, "method": method, "budget": budget, "label": label, "status": "ok",
            "rss_bytes": int(rss * MiB), "time_ratio": ratio, "peak_ratio": rss / 100, **extra}


def _checks(rows: list[dict[str, Any]], target: str) -> list[tuple[str, str, str]]:
    return [(c.subject, c.verdict, c.detail) for c in check_targets(rows, [])
            if c.target == target]


def test_speed_at_each_peers_peak_needs_095_time_at_105_memory() -> None:
    rows = [
        _row("llama", "unmodified", None, 100, 1.0),
        _row("llama", "fxckpt", 0.5, 50, 1.10),
        _row("llama", "fxckpt", 40 * MiB, 41.5, 1.00, match="sac_ops", label="fxckpt @sac_ops"),
        _row("llama", "sac_ops", None, 40, 1.06),  # 1.00 / 1.06 = 0.943 at 1.0375x: PASS
        _row("llama", "sac_megatron", None, 48, 1.05),  # best within 50.4: 1.00 / 1.05 = 0.952
        _row("llama", "checkpoint_per_block", None, 30, 1.3),  # nothing at <= 31.5 MiB
        _row("llama", "compile", 0.5, 60, 1.2),
        _row("llama", "compile", 0.25, 60, 1.2),  # only compile b=0.5 is the peer
        _row("mlp", "unmodified", None, 100, 1.0),
        _row("mlp", "checkpoint_per_block", None, 30, 1.3),  # not one of the models
    ]
    got = _checks(rows, "speed at the peer's peak")
    assert [(s, v) for s, v, _ in got] == [
        ("llama sac_ops", "PASS"), ("llama sac_megatron", "FAIL"),
        ("llama checkpoint_per_block", "FAIL"), ("llama compile b=0.5", "PASS")]
    assert got[0][2] == ("fxckpt @sac_ops: 41.5 MiB (1.038x the peer's 40.0 MiB), 1.00x time vs "
                         "the peer's 1.06x: fxckpt/peer time = 0.943 (limit 0.95)")
    assert "fxckpt/peer time = 0.952 (limit 0.95)" in got[1][2]
    assert got[2][2] == ("no timed fxckpt point at or below 1.05 x the peer's peak 30.0 MiB = "
                         "31.5 MiB")
    # the Pareto dominance target holds the new peers too
    dominance = [s for s, _, _ in _checks(rows, "Pareto dominance")]
    assert "llama sac_ops" in dominance and "llama sac_megatron" in dominance


def test_llama_at_066_of_its_peak_needs_at_most_110_time() -> None:
    base = _row("llama", "unmodified", None, 100, 1.0)
    for ratio, verdict in ((1.10, "PASS"), (1.11, "FAIL")):
        (got,) = _checks([base, _row("llama", "fxckpt", 0.66, 64, ratio)], "time at 0.66")
        assert got[:2] == ("llama fxckpt b=0.66", verdict)
        assert got[2] == (f"step time {ratio:.3f}x the unmodified model's (limit 1.10); "
                          f"peak 0.640x the unmodified model's")
    infeasible = dict(_row("llama", "fxckpt", 0.66, 0, 0), status="infeasible",
                      error="BudgetInfeasibleError: no")
    (got,) = _checks([base, infeasible], "time at 0.66")
    assert got[1:] == ("FAIL", "no timed measurement: infeasible: BudgetInfeasibleError: no")
    assert _checks([base], "time at 0.66") == [("llama fxckpt b=0.66", "SKIP", "not run")]
    assert _checks([_row("gpt2", "fxckpt", 0.66, 64, 2.0)], "time at 0.66") == []


def test_the_runner_adds_066_for_llamas_fxckpt_only_and_matches_the_new_peers() -> None:
    opts = BenchOptions(models=("gpt2", "llama"), methods=("fxckpt", "sac_ops", "sac_megatron",
                                                           "compile"), budgets=(0.5, 0.75))
    got = [(c.model, c.label) for c in configurations(opts)]
    assert got == [("gpt2", "unmodified"), ("gpt2", "fxckpt b=0.5"), ("gpt2", "fxckpt b=0.75"),
                   ("gpt2", "sac_ops"), ("gpt2", "sac_megatron"), ("gpt2", "compile b=0.5"),
                   ("gpt2", "compile b=0.75"),
                   ("llama", "unmodified"), ("llama", "fxckpt b=0.5"), ("llama", "fxckpt b=0.66"),
                   ("llama", "fxckpt b=0.75"), ("llama", "sac_ops"), ("llama", "sac_megatron"),
                   ("llama", "compile b=0.5"), ("llama", "compile b=0.75")]
    configs = [c for c in configurations(opts) if c.model == "llama"]
    peaks = {"unmodified": 100, "sac_ops": 60, "sac_megatron": 101}  # megatron saved nothing
    memory = {c: {"status": "ok", "rss_bytes": int(peaks.get(c.label, 200) * MiB)}
              for c in configs}
    assert [(c.label, c.budget) for c in matched_configs(configs, memory)] == [
        ("fxckpt @sac_ops", 60 * MiB)]
    assert configurations(BenchOptions(models=("llama",), methods=("sac_ops",)))[-1].label == \
        "sac_ops"  # no fxckpt asked for: no 0.66 row


def test_an_extra_budget_outside_0_1_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match=r"budgets must be fractions in \(0, 1\] \(got \(0\.5,\), "
                                         r"extra_budgets \(\('llama', 1\.5\),\)\)"):
        BenchOptions(budgets=(0.5,), extra_budgets=(("llama", 1.5),))


def test_a_row_matched_to_a_peer_is_compared_by_its_ratio_timed_by_turns_with_it() -> None:
    """Two children's baselines drift: the matched row's direct ratio to its peer decides."""
    rows = [
        _row("gpt2", "unmodified", None, 100, 1.0),
        # against its own baseline 1.40 / 1.30 = 1.077, but timed by turns with the peer 0.94
        _row("gpt2", "fxckpt", 30 * MiB, 30, 1.40, match="checkpoint_per_block",
             label="fxckpt @checkpoint_per_block", peer_ratio=0.94),
        _row("gpt2", "checkpoint_per_block", None, 30, 1.30),
        # a peer it shares the row with (not the one it was timed with): ratio of ratios
        _row("gpt2", "checkpoint_sequential", None, 30.2, 1.30),
    ]
    got = {s: (v, d) for s, v, d in _checks(rows, "speed at the peer's peak")}
    assert got["gpt2 checkpoint_per_block"][0] == "PASS"
    assert ("fxckpt/peer time = 0.940 (timed by turns with the peer) (limit 0.95)"
            in got["gpt2 checkpoint_per_block"][1])
    assert got["gpt2 checkpoint_sequential"][0] == "FAIL"
    assert "fxckpt/peer time = 1.077 (limit 0.95)" in got["gpt2 checkpoint_sequential"][1]
    pareto = {s: (v, d) for s, v, d in _checks(rows, "Pareto dominance")}
    assert pareto["gpt2 checkpoint_per_block"][0] == "PASS"
    assert "= 0.940 (timed by turns with the peer)" in pareto["gpt2 checkpoint_per_block"][1]


def test_matched_rows_are_timed_with_their_peer_except_compile() -> None:
    from benchmarks.runner import _kwargs

    opts = BenchOptions(models=("gpt2",), methods=("fxckpt", "checkpoint_per_block", "compile"),
                        budgets=(0.5,))
    configs = configurations(opts)
    peaks = {"unmodified": 100, "checkpoint_per_block": 20, "compile b=0.5": 60}
    memory = {c: {"status": "ok", "rss_bytes": int(peaks.get(c.label, 200) * MiB)}
              for c in configs}
    matched = matched_configs(configs, memory)
    assert [(c.label, c.paired) for c in matched] == [
        ("fxckpt @checkpoint_per_block", ("checkpoint_per_block", None)),
        ("fxckpt @compile b=0.5", None)]
    assert _kwargs(matched[0], opts, "measure_time")["peer"] == ["checkpoint_per_block", None]
    assert "peer" not in _kwargs(matched[0], opts, "measure_memory")
    assert "peer" not in _kwargs(matched[1], opts, "measure_time")


def test_the_time_child_times_the_peer_by_turns_with_the_method() -> None:
    from benchmarks.child import measure_time

    got = measure_time("mlp", "fxckpt", 0.5, quick=True, repeats=3,
                       peer=["checkpoint_per_block", None])
    assert got["status"] == "ok", got
    assert len(got["peer_samples"]) == len(got["step_samples"]) == len(got["base_samples"]) == 3
    assert got["peer_ratio"] == got["step_s"] / got["peer_step_s"]
    assert got["peer_step_s"] == sorted(got["peer_samples"])[1]
    plain = measure_time("mlp", "fxckpt", 0.5, quick=True, repeats=1)
    assert plain["status"] == "ok" and "peer_ratio" not in plain

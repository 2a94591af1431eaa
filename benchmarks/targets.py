"""The issue's targets, checked on the measured rows: PASS, FAIL or SKIP, with the numbers.

* **budget held**: fxckpt's measured (RSS) peak <= 1.05 x b x the unmodified model's measured
  peak, at every budget of the grid. (A fraction means a fraction of the real, measured eager
  peak; the check against the plan's own budget in bytes is shown alongside.) For
  ``fxckpt @peer`` rows the budget is bytes (the peer's measured peak): measured <= 1.05 x it.
  A budget the solver calls infeasible is held to the minimum its ``BudgetInfeasibleError``
  states: fxckpt is run again with ``budget=err.min_budget`` (the ``fxckpt @minimum of b=...``
  row) and the target PASSES only if that run's measured peak is <= 1.05 x ``min_budget``; a
  minimum that was not measured, failed, or was itself infeasible is a FAIL.
* **budget held** applies to the ``fxckpt_compiled`` row too (its measured peak against its
  budget in bytes); **prediction** does not: the plan states the eager step's peak.
* **prediction**: the peak the plan states (``plan.peak_bytes``, what every view shows: the
  verified figure where verification ran, else the simulator's) within 10% of the measured peak,
  for every fxckpt row, and ``plan.eager_peak_bytes`` within 10% of the unmodified model's
  measured peak. The detail also gives the simulator's own figure (``plan.predicted_peak``).
* **Pareto dominance**: for each peer point (per-block checkpoint, checkpoint_sequential,
  torch.compile with inductor at each budget), fxckpt dominates when one of its measured points
  (the budget grid, the stated minimums, the ``fxckpt @peer`` rows, and for ``compile`` peers
  only the compiled ``fxckpt_compiled`` row) has

  - **memory**: measured peak <= the peer's measured peak + the memory noise, where the memory
    noise is the larger spread (max - min) of the RSS samples of the two rows compared (no other
    tolerance), and
  - **time**: step-time ratio <= the peer's x (1 + the timing noise), where the timing noise of
    a model is the largest distance from 1.00 among the ratios of its unmodified model against
    its own deep copy, each ratio taken like a row's (median of ``repeats`` alternating pairs),
    several groups in one process.

  Among the points that meet the memory condition the fastest is compared (fxckpt/peer time:
  see :func:`versus`). Otherwise it is a FAIL: no point at or below the peer's memory, or slower
  beyond the noise. A time difference within the noise is a tie (the detail says so).
* **speed at the peer's peak** (issue 13) on GPT-2, BERT and the Llama-style model, for each
  peer point (per-block checkpoint, ``checkpoint_sequential``, the two op-level policies, and
  ``compile`` at budget 0.5): among fxckpt's measured points with peak <= 1.05 x the peer's
  measured peak (the ``fxckpt @peer`` row is made for this), the fastest has step-time ratio
  <= 0.95 x the peer's. No noise allowance: the thresholds are the issue's. The ``fxckpt @peer``
  row of a peer other than ``compile``, and the ``fxckpt_compiled @compile b=0.5`` row, are
  timed by turns with that peer in one child, and that direct ratio is its fxckpt/peer time
  (two children's baselines drift apart by 5-10% on this machine); other points compare their
  ratios to their own baselines.
* **Llama at 0.66** (issue 13): ``fxckpt b=0.66`` on the Llama-style model (a budget the runner
  adds to the grid for it) has step-time ratio <= 1.10 x the unmodified model's.
* **solve time**: the solver alone under 1 s on the 12-layer GPT-2 graph (every budget of the
  benchmark's GPT-2, and the scaling run's 12-layer graph).
* **scaling** (issue 14): solver time grows at most linearly with graph size: the log-log slope
  of seconds against ops between each pair of consecutive graph sizes is at most 1.1 (each pair,
  not only the end points, so a cheaper regime for large graphs cannot hide a steep one in
  between); and the largest graph, when it has at least 20,000 ops, is solved in under 3 s. The
  solver is what ``transform`` runs: per repeated block on large graphs. These two are checked
  in :mod:`benchmarks.solver_targets`.

Failures are reported, never hidden: the thresholds are the issue's, fixed before any run.
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks.check import Check, ok as _ok
from benchmarks.methods import COMPILED, OURS, PEERS
from benchmarks.solver_targets import MAX_SLOPE, SOLVE_LIMIT_S, scaling_checks, solve_checks

__all__ = ["Check", "check_targets", "timing_noise", "memory_noise", "noise_summary", "versus",
           "BUDGET_TOL",
           "PREDICT_TOL", "SOLVE_LIMIT_S", "MAX_SLOPE", "PEERS", "PEER_SPEED", "PEER_MEMORY",
           "SPEED_MODELS", "LLAMA_FRACTION", "LLAMA_TIME_LIMIT"]

BUDGET_TOL = 0.05
PREDICT_TOL = 0.10
PEER_SPEED = 0.95
"""fxckpt's step time at most this x the peer's ..."""
PEER_MEMORY = 1.05
"""... at a peak of at most this x the peer's."""
SPEED_MODELS = ("gpt2", "bert", "llama")
SPEED_COMPILE_BUDGET = 0.5
"""The one ``compile`` point the speed target compares with."""
LLAMA_FRACTION = 0.66
LLAMA_TIME_LIMIT = 1.10

Row = dict[str, Any]
MiB = 2**20


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def _size(n: float) -> str:
    return _mib(n) if n >= MiB else f"{n / 1024:.0f} KiB"


def _base(rows: list[Row], model: str) -> Optional[Row]:
    return next((r for r in rows if r["model"] == model and r["method"] == "unmodified"), None)


def _budget_check(row: Row, base: Optional[Row], rows: list[Row]) -> Check:
    subject = f"{row['model']} {row['label']}"
    if row.get("status") == "infeasible":
        return _infeasible_check(row, rows)
    if not _ok(row) or not _ok(base):
        why = row.get("error") if not _ok(row) else "unmodified model not measured"
        return Check("budget held", subject, False, f"no measurement: {why}")
    assert base is not None
    if row.get("match"):
        limit = row["budget"]
        detail = (
            f"measured {_mib(row['rss_bytes'])} vs {1 + BUDGET_TOL:.2f} x {_mib(limit)} "
            f"(the peer's peak) = {_mib((1 + BUDGET_TOL) * limit)}: "
            f"{row['rss_bytes'] / limit:.3f}x the budget"
        )
        return Check("budget held", subject, row["rss_bytes"] <= (1 + BUDGET_TOL) * limit, detail)
    limit = row["budget"] * base["rss_bytes"]
    ok = row["rss_bytes"] <= (1 + BUDGET_TOL) * limit
    detail = (f"measured {_mib(row['rss_bytes'])} vs {1 + BUDGET_TOL:.2f} x {row['budget']:g} x "
              f"{_mib(base['rss_bytes'])} = {_mib((1 + BUDGET_TOL) * limit)} "
              f"(peak ratio {row['rss_bytes'] / base['rss_bytes']:.3f})")
    if row.get("budget_bytes"):
        detail += (f"; vs the plan's own budget {_mib(row['budget_bytes'])}: "
                   f"{row['rss_bytes'] / row['budget_bytes']:.3f}x")
    return Check("budget held", subject, ok, detail)


def _infeasible_check(row: Row, rows: list[Row]) -> Check:
    """An infeasible budget passes only if the minimum its error states is met when measured."""
    subject = f"{row['model']} {row['label']} (infeasible)"
    minimum = row.get("min_budget")
    if not minimum:
        return Check("budget held", subject, False,
                     f"infeasible, no minimum stated: {row.get('error')}")
    stated = f"solver says infeasible and states a minimum of {_mib(minimum)} ({minimum} bytes)"
    retry = next((r for r in rows if r["model"] == row["model"]
                  and r.get("minimum_of") == row["label"]), None)
    if retry is None:
        return Check("budget held", subject, False, f"{stated}; that minimum was not measured")
    if not _ok(retry):
        why = f"{retry.get('status')}: {retry.get('error')}"
        return Check("budget held", subject, False, f"{stated}; with budget={minimum}: {why}")
    measured, limit = retry["rss_bytes"], (1 + BUDGET_TOL) * minimum
    return Check("budget held", subject, measured <= limit,
                 f"{stated}; with budget={minimum}: measured {_mib(measured)} vs "
                 f"{1 + BUDGET_TOL:.2f} x {_mib(minimum)} = {_mib(limit)}: "
                 f"{measured / minimum:.3f}x the stated minimum")


def _prediction(
    subject: str, stated: Optional[int], measured: Optional[int], tracked: Optional[int],
    simulated: Optional[int] = None,
) -> Check:
    if not stated or not measured:
        return Check("prediction", subject, None, "no prediction or no measurement")
    err = stated / measured - 1
    detail = f"plan states {_mib(stated)} vs measured {_mib(measured)} ({err:+.1%})"
    if tracked:
        detail += f"; vs tracked tensors {_mib(tracked)} ({stated / tracked - 1:+.1%})"
    if simulated and simulated != stated:
        detail += f"; the simulator alone said {_mib(simulated)} ({simulated / measured - 1:+.1%})"
    return Check("prediction", subject, abs(err) <= PREDICT_TOL, detail)


def _prediction_checks(rows: list[Row], model: str) -> list[Check]:
    mine = [r for r in rows if r["model"] == model and r["method"] == "fxckpt"]
    checks = [_prediction(f"{model} {r['label']}", r.get("plan_peak"), r.get("rss_bytes"),
                          r.get("tracked_bytes"), r.get("predicted_peak"))
              for r in mine if _ok(r)]
    base = _base(rows, model)
    eager = next((r for r in mine if _ok(r) and r.get("eager_plan_peak")), None)
    if _ok(base) and eager:
        assert base is not None
        checks.append(
            _prediction(
                f"{model} unmodified (plan.eager_peak_bytes)",
                eager["eager_plan_peak"],
                base["rss_bytes"],
                base.get("tracked_bytes"),
                eager.get("eager_predicted"),
            )
        )
    if not checks:
        why = "; ".join(sorted({str(r.get("error")) for r in mine})) or "fxckpt not run"
        checks.append(
            Check("prediction", model, False if mine else None, f"no fxckpt measurement: {why}")
        )
    return checks


def timing_noise(rows: list[Row], model: str) -> Optional[tuple[float, int]]:
    """Largest distance from 1 among the unmodified model's time ratios against its own copy
    (``group_ratios`` of its time child; its one ``time_ratio`` when those are missing), and how
    many ratios that is; ``None`` when the unmodified model was not timed."""
    base = _base(rows, model)
    if base is None:
        return None
    ratios = base.get("group_ratios") or ([base["time_ratio"]] if base.get("time_ratio") else [])
    return (max(abs(r - 1) for r in ratios), len(ratios)) if ratios else None


def memory_noise(*compared: Row) -> int:
    """The larger spread (max - min, bytes) of the RSS samples of the rows compared."""
    return max((max(s) - min(s) for r in compared if (s := r.get("rss_samples"))), default=0)


def noise_summary(rows: list[Row]) -> str:
    """The timing noise of every model, for the report."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        noise = timing_noise(rows, model)
        parts.append(f"{model} ±{noise[0]:.1%} ({noise[1]} ratios)" if noise
                     else f"{model} not measured (0 used)")
    return "; ".join(parts)


def _dominance(peer: Row, ours: list[Row], noise: Optional[tuple[float, int]]) -> Check:
    subject = f"{peer['model']} {peer['label']}"
    if not _ok(peer) or peer.get("time_ratio") is None:
        return Check(
            "Pareto dominance",
            subject,
            None,
            f"peer not measured: {peer.get('error') or peer.get('time_error')}",
        )
    timed = [r for r in ours if _ok(r) and r.get("time_ratio") is not None]
    fit = [r for r in timed if r["rss_bytes"] <= peer["rss_bytes"] + memory_noise(r, peer)]
    if not fit:
        lowest = min((r["rss_bytes"] for r in timed), default=None)
        got = _mib(lowest) if lowest is not None else "no measured fxckpt point"
        why = next((f"; fxckpt @{peer['label']}: {r['status']}: {r.get('error')}" for r in ours
                    if r.get("match") == peer["label"] and not _ok(r)), "")
        return Check("Pareto dominance", subject, False,
                     f"no fxckpt point at or below the peer's peak {_mib(peer['rss_bytes'])} + "
                     f"its memory noise (lowest: {got}){why}")
    best = min(fit, key=lambda r: versus(r, peer))
    speed = versus(best, peer)
    tn = noise[0] if noise else 0.0
    verdict = ("faster beyond the noise" if speed < 1 - tn
               else "slower beyond the noise" if speed > 1 + tn else "equal within the noise")
    source = f"timing noise of {noise[1]} self-ratios" if noise else "timing noise not measured"
    detail = (f"{best['label']}: {_mib(best['rss_bytes'])}, {best['time_ratio']:.2f}x time vs "
              f"peer {_mib(peer['rss_bytes'])}, {peer['time_ratio']:.2f}x time (memory noise "
              f"{_size(memory_noise(best, peer))}): fxckpt/peer time = {speed:.3f}"
              f"{_how(best, peer)}, "
              f"limit 1 + {tn:.1%} ({source}): {verdict}")
    return Check("Pareto dominance", subject, speed <= 1 + tn, detail)


def _paired(row: Row, peer: Row) -> bool:
    """``row`` was timed by turns with ``peer``: the row matched to it, or the run at the minimum
    stated when that row's budget was infeasible (``paired_with``; rows from before it was
    recorded name the peer in ``match``)."""
    return (row.get("paired_with", row.get("match")) == peer["label"]
            and row.get("peer_ratio") is not None)


def versus(row: Row, peer: Row) -> float:
    """fxckpt's step time over the peer's: timed by turns in one child for the row matched to
    this peer (``peer_ratio``), else the ratio of the two rows' ratios to their own baselines."""
    if _paired(row, peer):
        return float(row["peer_ratio"])
    return float(row["time_ratio"]) / float(peer["time_ratio"])


def _how(row: Row, peer: Row) -> str:
    return " (timed by turns with the peer)" if _paired(row, peer) else ""


def _speed(peer: Row, ours: list[Row]) -> Check:
    subject = f"{peer['model']} {peer['label']}"
    target = "speed at the peer's peak"
    if not _ok(peer) or peer.get("time_ratio") is None:
        why = peer.get("error") or peer.get("time_error")
        return Check(target, subject, None, f"peer not measured: {why}")
    limit = PEER_MEMORY * peer["rss_bytes"]
    fit = [r for r in ours if _ok(r) and r.get("time_ratio") is not None
           and r["rss_bytes"] <= limit]
    if not fit:
        return Check(target, subject, False, f"no timed fxckpt point at or below {PEER_MEMORY:.2f}"
                     f" x the peer's peak {_mib(peer['rss_bytes'])} = {_mib(limit)}")
    best = min(fit, key=lambda r: versus(r, peer))
    speed = versus(best, peer)
    return Check(target, subject, speed <= PEER_SPEED,
                 f"{best['label']}: {_mib(best['rss_bytes'])} "
                 f"({best['rss_bytes'] / peer['rss_bytes']:.3f}x the peer's "
                 f"{_mib(peer['rss_bytes'])}), {best['time_ratio']:.2f}x time vs the peer's "
                 f"{peer['time_ratio']:.2f}x: fxckpt/peer time = {speed:.3f}"
                 f"{_how(best, peer)} (limit {PEER_SPEED:.2f})")


def _speed_checks(rows: list[Row], model: str) -> list[Check]:
    if model not in SPEED_MODELS:
        return []
    return [_speed(p, _ours_for(p, rows)) for p in rows if p["model"] == model
            and p["method"] in PEERS
            and (p["method"] != "compile" or p["budget"] == SPEED_COMPILE_BUDGET)]


def _ours_for(peer: Row, rows: list[Row]) -> list[Row]:
    """fxckpt's rows that ``peer`` is compared with: all of them for a compiled peer, only the
    eager ones for an eager peer (a compiled fxckpt against an eager peer would compare
    inductor's fused kernels with eager ones, not the plans)."""
    kinds = OURS if peer["method"] in COMPILED else tuple(m for m in OURS if m not in COMPILED)
    return [r for r in rows if r["model"] == peer["model"] and r["method"] in kinds]


def _llama_check(rows: list[Row]) -> list[Check]:
    """fxckpt at 0.66 of the Llama-style model's unmodified peak: step time <= 1.10x."""
    mine = [r for r in rows if r["model"] == "llama"]
    if not mine:
        return []
    target, subject = f"time at {LLAMA_FRACTION:g}", f"llama fxckpt b={LLAMA_FRACTION:g}"
    row = next((r for r in mine if r["method"] == "fxckpt" and r["budget"] == LLAMA_FRACTION
                and not r.get("match") and not r.get("minimum_of")), None)
    if row is None:
        return [Check(target, subject, None, "not run")]
    if not _ok(row) or row.get("time_ratio") is None:
        why = f"{row.get('status')}: {row.get('error') or row.get('time_error')}"
        return [Check(target, subject, False, f"no timed measurement: {why}")]
    ratio, peak = row["time_ratio"], row.get("peak_ratio")
    memory = f"peak {peak:.3f}x the unmodified model's" if peak else "peak ratio not measured"
    return [Check(target, subject, ratio <= LLAMA_TIME_LIMIT,
                  f"step time {ratio:.3f}x the unmodified model's (limit "
                  f"{LLAMA_TIME_LIMIT:.2f}); {memory}")]


def check_targets(rows: list[Row], scaling: list[Row]) -> list[Check]:
    """Every target on every model, in the issue's order."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    checks: list[Check] = []
    for model in models:
        checks += [_budget_check(r, _base(rows, model), rows) for r in rows
                   if r["model"] == model and r["method"] in OURS and not r.get("minimum_of")]
    for model in models:
        checks += _prediction_checks(rows, model)
    for model in models:
        noise = timing_noise(rows, model)
        checks += [
            _dominance(p, _ours_for(p, rows), noise)
            for p in rows
            if p["model"] == model and p["method"] in PEERS
        ]
    for model in models:
        checks += _speed_checks(rows, model)
    checks += _llama_check(rows)
    return checks + solve_checks(rows, scaling) + scaling_checks(scaling)

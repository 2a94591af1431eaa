"""Run every configuration in its own subprocesses and gather the rows.

    for each (model, method, budget):
        memory child  (MALLOC_MMAP_THRESHOLD_ set)  -> RSS peak, tracked peak, plan facts
    for each peer that saved memory (match_peers):
        memory child  fxckpt with budget = the peer's measured peak in bytes ("fxckpt @peer")
                      and, for compile b=0.5, the same compiled ("fxckpt_compiled @compile b=0.5")
    for each fxckpt budget (of the grid or matched) the solver found infeasible:
        memory child  fxckpt with budget = the minimum its error stated ("fxckpt @minimum of b=")
    for each configuration that worked:
        time child    (default allocator)           -> median step, baseline step, ratio
                      (the unmodified model: NOISE_GROUPS x repeats pairs against its own copy,
                      whose per-group ratios are the timing noise)
    for each layer count:
        scaling child                                -> solver seconds on a GPT-2 graph

Memory children may run ``jobs`` at a time (each process's RSS is its own); time children run
one at a time. A child that crashes or times out becomes an error row.

The ``fxckpt @peer`` rows make the Pareto comparison exact: a peer is compared with fxckpt asked
for the very memory the peer was measured to use, not only with the nearest budget of the grid.
The ``fxckpt @minimum`` rows hold an infeasible budget's error to its word: the minimum it states
must be met when measured.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from benchmarks.methods import BUDGETED, COMPILE_BACKEND, MATCHED_ONLY, METHODS, PEERS
from benchmarks.models import MODEL_NAMES, spec_for
from benchmarks.targets import LLAMA_FRACTION, SPEED_COMPILE_BUDGET

__all__ = ["BenchOptions", "Config", "configurations", "run_bench", "label", "matched_configs",
           "minimum_configs", "NOISE_GROUPS"]

log = logging.getLogger(__name__)

Row = dict[str, Any]

NOISE_GROUPS = 5
"""Groups of ``repeats`` paired steps timed for the unmodified model against its own copy."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What to run."""

    models: tuple[str, ...] = MODEL_NAMES
    """Benchmark models (keys of :data:`benchmarks.models.MODELS`)."""
    methods: tuple[str, ...] = METHODS
    """Methods to run; ``unmodified`` is always added (every ratio needs it)."""
    budgets: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Budget fractions for ``fxckpt`` and ``compile``."""
    repeats: int = 3
    """Steps per median (memory and time)."""
    quick: bool = False
    """Tiny model sizes (tests)."""
    jobs: int = 2
    """Memory-measuring subprocesses at once."""
    compile_backend: str = COMPILE_BACKEND
    """Backend of the ``compile`` peer (a test hook: a bogus name must give error rows)."""
    scaling_layers: tuple[int, ...] = (12, 48, 192, 436)
    """GPT-2 layer counts for the solver-scaling measurement (empty: skip it)."""
    scaling_budget: float = 0.5
    """Budget fraction the solver-scaling measurement solves for."""
    match_peers: bool = True
    """Also run fxckpt with each peer's measured peak as its budget in bytes."""
    extra_budgets: tuple[tuple[str, float], ...] = (("llama", LLAMA_FRACTION),)
    """``(model, fraction)``: fxckpt-only budgets on top of the grid, for targets that name one
    (the Llama-style model at 0.66 of its unmodified peak)."""
    timeout: float = 900.0
    """Seconds before a child is abandoned (its row becomes an error)."""

    def __post_init__(self) -> None:
        for name in self.models:
            spec_for(name)
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
        extra = tuple(b for _, b in self.extra_budgets)
        if any(not 0.0 < b <= 1.0 for b in self.budgets + extra) or not self.budgets:
            raise ValueError(f"budgets must be fractions in (0, 1] (got {self.budgets}, "
                             f"extra_budgets {self.extra_budgets})")
        if self.repeats < 1 or self.jobs < 1:
            raise ValueError(
                f"repeats and jobs must be positive (got {self.repeats}, {self.jobs})"
            )


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration."""

    model: str
    method: str
    budget: Optional[float]
    """A fraction; for a ``match`` row, bytes (an ``int``)."""
    match: Optional[str] = None
    """Label of the peer whose measured peak is this row's budget."""
    minimum_of: Optional[str] = None
    """Label of the infeasible row whose stated minimum (bytes) is this row's budget."""
    paired: Optional[tuple[str, Optional[float]]] = None
    """For a ``match`` row: the peer's method and budget, which its time child times by turns
    with it (``None`` for ``compile``, whose compilation would lengthen every such child)."""

    @property
    def label(self) -> str:
        return label(self.method, self.budget, self.match, self.minimum_of)


def label(method: str, budget: Optional[float], match: Optional[str] = None,
          minimum_of: Optional[str] = None) -> str:
    """Row label: ``fxckpt b=0.5``, ``checkpoint_per_block``, ``fxckpt @checkpoint_per_block``,
    ``fxckpt @minimum of b=0.25``."""
    if minimum_of is not None:
        return f"{method} @minimum of {minimum_of.removeprefix(method + ' ')}"
    if match is not None:
        return f"{method} @{match}"
    return method if budget is None else f"{method} b={budget:g}"


def configurations(opts: BenchOptions) -> list[Config]:
    """Every (model, method, budget) to measure, unmodified first within each model."""
    methods = ["unmodified"] + [m for m in METHODS if m in opts.methods
                                and m != "unmodified" and m not in MATCHED_ONLY]
    return [Config(model, method, budget)
            for model in opts.models for method in methods
            for budget in _budgets(opts, model, method)]


def _budgets(opts: BenchOptions, model: str, method: str) -> tuple[Optional[float], ...]:
    if method not in BUDGETED:
        return (None,)
    extra = [b for m, b in opts.extra_budgets if m == model and method == "fxckpt"]
    return tuple(sorted(set(opts.budgets) | set(extra)))


def _child(function: str, kwargs: dict[str, Any], *, mmap: bool, timeout: float) -> Row:
    from fxckpt.measure import MMAP_THRESHOLD, MeasureError, run_in_subprocess

    try:
        return run_in_subprocess(f"benchmarks.child:{function}", kwargs,
                                 mmap_threshold=MMAP_THRESHOLD if mmap else None, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {
            "status": "error",
            "error": f"the {function} subprocess took more than {timeout:.0f} s",
        }
    except MeasureError as e:
        tail = str(e).strip().splitlines()[-1] if str(e).strip() else "no output"
        return {"status": "error", "error": f"subprocess crashed: {tail}"}


def _kwargs(cfg: Config, opts: BenchOptions, function: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"model": cfg.model, "method": cfg.method, "budget": cfg.budget,
                              "quick": opts.quick, "repeats": opts.repeats,
                              "compile_backend": opts.compile_backend}
    if cfg.match is not None or cfg.minimum_of is not None:
        kwargs["time_solver"] = False
    if function == "measure_time" and cfg.method == "unmodified":
        kwargs["groups"] = NOISE_GROUPS
    if function == "measure_time" and cfg.paired is not None:
        kwargs["peer"] = list(cfg.paired)
    return kwargs


def _progress(start: float, done: int, total: int, cfg: Config, row: Row, what: str) -> None:
    status = row.get("status")
    if status == "ok" and what == "memory":
        result = f"{row['rss_bytes'] / 2**20:.1f} MiB"
    elif status == "ok":
        result = f"{row['step_s'] * 1000:.0f} ms ({row['time_ratio']:.2f}x)"
    else:
        result = f"{status}: {str(row.get('error'))[:100]}"
    print(f"[{time.perf_counter() - start:6.0f} s] {what} {done}/{total} {cfg.model} "
          f"{cfg.label}: {result}", file=sys.stderr, flush=True)


def _measure_all(configs: list[Config], opts: BenchOptions, function: str, jobs: int,
                 start: float) -> dict[Config, Row]:
    what = "memory" if function == "measure_memory" else "time"
    results: dict[Config, Row] = {}

    def one(cfg: Config) -> tuple[Config, Row]:
        return cfg, _child(function, _kwargs(cfg, opts, function), mmap=what == "memory",
                           timeout=opts.timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for cfg, row in pool.map(one, configs):
            results[cfg] = row
            _progress(start, len(results), len(configs), cfg, row, what)
    return results


def _merge(cfg: Config, memory: Row, timing: Optional[Row]) -> Row:
    row: Row = {"model": cfg.model, "method": cfg.method, "budget": cfg.budget, "match": cfg.match,
                "minimum_of": cfg.minimum_of, "label": cfg.label, **memory}
    if cfg.paired is not None:
        row["paired_with"] = label(*cfg.paired)
    if timing is None:
        return row
    if timing.get("status") == "ok":
        row.update({k: v for k, v in timing.items() if k != "status"})
    else:
        row["time_error"] = timing.get("error")
    return row


def _add_ratios(rows: list[Row]) -> None:
    """Memory ratios against the unmodified row of the same model (time ratios come from the
    time child, which timed its own baseline)."""
    base = {r["model"]: r for r in rows if r["method"] == "unmodified" and r.get("status") == "ok"}
    for row in rows:
        b = base.get(row["model"])
        if row.get("status") != "ok" or b is None:
            continue
        row["peak_ratio"] = row["rss_bytes"] / b["rss_bytes"] if b["rss_bytes"] else None
        if row.get("tracked_bytes") and b.get("tracked_bytes"):
            row["tracked_ratio"] = row["tracked_bytes"] / b["tracked_bytes"]
        if row.get("plan_peak") and row["rss_bytes"]:
            row["plan_over_measured"] = row["plan_peak"] / row["rss_bytes"]


PEER_METHODS = PEERS


def matched_configs(configs: list[Config], memory: dict[Config, Row],
                    compiled: bool = False) -> list[Config]:
    """``fxckpt`` with each peer's measured peak as its budget, for every peer that used less
    memory than the unmodified model. A peer whose peak is at most 1% above a budget already
    matched shares that row (its budget is not above this peer's peak, so the comparison stays
    fair to the peer). With ``compiled``, the ``compile`` peer at the speed target's budget also
    gets ``fxckpt_compiled`` at its peak, timed by turns with it."""
    base = {c.model: memory[c].get("rss_bytes") for c in configs if c.method == "unmodified"}
    matched: list[Config] = []
    for cfg in configs:
        peak = memory[cfg].get("rss_bytes") if memory[cfg].get("status") == "ok" else None
        limit = base.get(cfg.model)
        if cfg.method not in PEER_METHODS or not peak or not limit or peak >= limit:
            continue
        if compiled and cfg.method == "compile" and cfg.budget == SPEED_COMPILE_BUDGET:
            matched.append(Config(cfg.model, "fxckpt_compiled", int(peak), match=cfg.label,
                                  paired=(cfg.method, cfg.budget)))
        if any(m.model == cfg.model and m.method == "fxckpt"
               and 0 <= peak - int(m.budget or 0) <= 0.01 * peak for m in matched):
            continue
        paired = None if cfg.method == "compile" else (cfg.method, cfg.budget)
        matched.append(Config(cfg.model, "fxckpt", int(peak), match=cfg.label, paired=paired))
    return matched


def minimum_configs(configs: list[Config], memory: dict[Config, Row]) -> list[Config]:
    """``fxckpt`` with ``budget=`` the minimum stated by each ``BudgetInfeasibleError`` (bytes),
    timed by turns with the peer the infeasible row was to be timed with."""
    return [Config(c.model, c.method, int(memory[c]["min_budget"]), minimum_of=c.label,
                   paired=c.paired)
            for c in configs
            if memory[c].get("status") == "infeasible" and memory[c].get("min_budget")]


def _in_report_order(configs: list[Config]) -> list[Config]:
    """Per model: unmodified, fxckpt on the grid, fxckpt matched to peers, then the peers; each
    ``@minimum`` row right after the infeasible row whose minimum it measures."""
    models = list(dict.fromkeys(c.model for c in configs))
    rank = {m: i for i, m in enumerate(METHODS)}
    main = sorted((c for c in configs if c.minimum_of is None),
                  key=lambda c: (models.index(c.model), rank[c.method], c.match is not None))
    ordered: list[Config] = []
    for cfg in main:
        ordered += [cfg] + [
            m for m in configs if m.model == cfg.model and m.minimum_of == cfg.label
        ]
    return ordered


SCALING_REPEATS = 3
"""Solves per size in the scaling run (each on a fresh problem; the median is reported): one
solve of the 192-layer graph took 0.68-1.27 s on this machine, enough to swing a slope."""


def _scaling(opts: BenchOptions, start: float) -> list[Row]:
    rows: list[Row] = []
    for n in opts.scaling_layers:
        result = _child(
            "solve_scaling",
            {"layers": [n], "budgets": [opts.scaling_budget], "repeats": SCALING_REPEATS},
            mmap=False,
            timeout=opts.timeout,
        )
        got = result.get("rows") or [
            {"layers": n, "status": "error", "error": result.get("error")}
        ]
        rows += got
        print(f"[{time.perf_counter() - start:6.0f} s] solver scaling {n} layers: "
              f"{', '.join(_scaling_text(r) for r in got)}", file=sys.stderr, flush=True)
    return rows


def _scaling_text(row: Row) -> str:
    return (
        f"{row['ops']} ops, {row['solve_s']:.2f} s"
        if row.get("status") == "ok"
        else f"error: {row.get('error')}"
    )


def run_bench(
    opts: BenchOptions, *, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """Measure every configuration; returns ``{"options", "rows", "scaling", "seconds"}``."""
    start = clock()
    configs = configurations(opts)
    memory = _measure_all(configs, opts, "measure_memory", opts.jobs, start)
    if opts.match_peers:
        matched = matched_configs(configs, memory, "fxckpt_compiled" in opts.methods)
        memory.update(_measure_all(matched, opts, "measure_memory", opts.jobs, start))
        configs += matched
    minimums = minimum_configs(configs, memory)
    memory.update(_measure_all(minimums, opts, "measure_memory", opts.jobs, start))
    configs = _in_report_order(configs + minimums)
    timed = [c for c in configs if memory[c].get("status") == "ok"]
    timing = _measure_all(timed, opts, "measure_time", 1, start)
    rows = [_merge(c, memory[c], timing.get(c)) for c in configs]
    _add_ratios(rows)
    scaling = _scaling(opts, start)
    return {
        "options": dataclasses.asdict(opts),
        "rows": rows,
        "scaling": scaling,
        "seconds": clock() - start,
    }

"""The budget solver where many values stay live across cuts: its time, memory and gap.

    python -m benchmarks.solver_graphs [--quick] [--graphs lstm-16,cell-1000] [--out docs]

Where every hidden state of a model is read again at its end, each is held for backward or not
depending on the plan, and the exact search's states double with every one of them
(:mod:`fxckpt.solver.bounds`). These graphs are planned as ``transform`` plans them: captured
and annotated, then :func:`fxckpt.solver.portfolio.solve_plan` at a fraction of the predicted
eager peak (its reserve included, as in ``transform``):

* ``lstm-T``: an unrolled ``nn.LSTMCell`` (width 32, batch 64) whose hidden states are all
  concatenated into one ``Linear`` at the end;
* ``dense-L``: a DenseNet-style block on vectors: each ``Linear`` reads the ``cat`` of every
  earlier output (growth 32);
* ``gru-stack-T``: an unrolled ``nn.GRUCell`` whose hidden states are stacked at the end;
* ``mlp-mix-L``: ``L`` layers of ``Linear`` + ReLU (width 64) whose outputs are all concatenated
  at the end (its smallest peak is about 0.82 of eager: budget 0.9);
* ``cell-N``: a synthetic problem (no torch) of ``N`` steps of a 4-op cell, every step's state
  read by one ``cat`` at the end: ``4N + 3`` ops and ``N`` values live at the last cut.

Each graph is measured in its own subprocess: the median wall time of ``repeats`` solves, each
on a fresh problem; then one more solve under ``tracemalloc`` (its peak of Python allocations:
the solver is pure Python) and the growth of the process's peak RSS over it.

The graphs of :data:`EXACT_GRAPHS` are then solved exactly, in a subprocess of their own with
:data:`EXACT_TIMEOUT`: the search over every segmentation with no limit on its work or states
(:func:`exact`), the optimum of the cost model for plans of segments. The plan, kept ops
included, is checked against it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fxckpt.solver import Op, Problem

__all__ = ["GRAPHS", "QUICK", "EXACT_GRAPHS", "EXACT_TIMEOUT", "unrolled_cell", "problem_for",
           "exact_optimum", "measure", "exact", "run", "render", "main"]

Row = dict[str, Any]

GRAPHS: dict[str, float] = {
    "lstm-16": 0.5, "lstm-24": 0.5, "lstm-32": 0.5, "dense-16": 0.5, "dense-24": 0.5,
    "gru-stack-32": 0.5, "mlp-mix-16": 0.9, "mlp-mix-24": 0.9, "cell-250": 0.7,
    "cell-1000": 0.7,
}
"""Each graph and the budget fraction it is planned for."""

QUICK = ("lstm-16", "cell-250")
"""The graphs of ``--quick``."""

EXACT_GRAPHS = ("lstm-16", "dense-16", "dense-24", "mlp-mix-16")
"""The graphs small enough to be solved exactly (here: 0.4-32 s, up to 1.3 GiB); on the others
the exact search's states run to millions."""

EXACT_TIMEOUT = 300.0
"""Seconds the exact search of one graph may take (its subprocess is stopped after that)."""


def unrolled_cell(steps: int, width: int = 8192) -> Problem:
    """``steps`` steps of a cell (a matmul reading the previous state, two pointwise ops, the new
    state), every state read by one ``cat`` at the end, then a head and a loss."""
    ops: list[Op] = []
    states: list[str] = []
    prev = "state"  # a graph input
    for t in range(steps):
        ops += [
            Op(name=f"mm{t}", out_bytes=4 * width, cost=4e6, inputs=(prev, "x"), saves=(prev,)),
            Op(name=f"act{t}", out_bytes=width, cost=2e4, inputs=(f"mm{t}",),
               saves=(f"act{t}",)),
            Op(name=f"gate{t}", out_bytes=width, cost=2e4, inputs=(f"act{t}",),
               saves=(f"act{t}",)),
            Op(name=f"h{t}", out_bytes=width, cost=1e4, inputs=(f"gate{t}", prev),
               saves=(f"gate{t}",)),
        ]
        prev = f"h{t}"
        states.append(prev)
    ops += [
        Op(name="cat", out_bytes=width * steps, cost=1e3 * steps, inputs=tuple(states)),
        Op(name="head", out_bytes=width, cost=4e6, inputs=("cat",), saves=("cat",)),
        Op(name="loss", out_bytes=4, cost=1.0, inputs=("head",), saves=("head",)),
    ]
    return Problem(ops=tuple(ops), outputs=("loss",))


def _model(kind: str, n: int) -> tuple[Any, tuple[Any, ...]]:
    import torch
    from torch import nn

    class Unrolled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cell = nn.LSTMCell(32, 32) if kind == "lstm" else nn.GRUCell(32, 32)
            self.cell, self.out = cell, nn.Linear(32 * n if kind == "lstm" else 32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = c = torch.zeros(x.shape[0], 32)
            hs = []
            for t in range(n):
                if kind == "lstm":
                    h, c = self.cell(x[:, t], (h, c))
                else:
                    h = self.cell(x[:, t], h)
                hs.append(h)
            if kind == "lstm":
                return self.out(torch.cat(hs, -1))
            return self.out(torch.stack(hs, 1)).mean(1)

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            grow = 32 if kind == "dense" else 0
            self.layers = nn.ModuleList(
                nn.Linear(64 + i * grow, grow or 64) for i in range(n))
            self.out = nn.Linear(64 + n * (grow or 64) - (0 if grow else 64), 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            feats = [x]
            for layer in self.layers:
                inp = torch.cat(feats, -1) if kind == "dense" else feats[-1]
                feats.append(torch.relu(layer(inp)))
            return self.out(torch.cat(feats if kind == "dense" else feats[1:], -1))

    torch.manual_seed(0)
    if kind in ("lstm", "gru-stack"):
        return Unrolled().train(), (torch.randn(64, n, 32),)
    return Mixed().train(), (torch.randn(64, 64),)


def _maker(graph: str) -> Callable[[], tuple[Problem, Any, Any]]:
    """A function giving a fresh (problem, keepable groups, blocks) for ``graph``."""
    kind, _, size = graph.rpartition("-")
    if kind == "cell":
        return lambda: (unrolled_cell(int(size)), [], [])
    from fxckpt.cost.annotate import annotate
    from fxckpt.capture.captured import capture
    from fxckpt.planning.blocks import block_ranges
    from fxckpt.cost.bridge import problem_of
    from fxckpt.capture.graphs import planned_nodes
    from fxckpt.planning.keeps import choices

    model, inputs = _model(kind, int(size))
    captured = capture(model, inputs, {})
    annotate(captured.gm, captured.graph_args(inputs, {}))
    order = planned_nodes(captured.gm.graph)

    def make() -> tuple[Problem, Any, Any]:
        problem = problem_of(captured.gm)
        return problem, choices(problem, order, {})[0], block_ranges(problem, order)

    return make


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def problem_for(graph: str, fraction: float) -> tuple[Problem, int]:
    """The problem of ``graph`` and its budget in bytes (``fraction`` of the unmodified step's
    simulated peak, the reserve included), as :func:`measure` plans it."""
    problem = _maker(graph)()[0]
    return problem, _target(problem, fraction)


def _target(problem: Problem, fraction: float) -> int:
    from fxckpt.solver import simulate

    return int(fraction * simulate(problem, ()).peak_bytes)


def exact_optimum(problem: Problem, target: int) -> Any:
    """The cheapest plan of segments for ``problem`` under ``target`` bytes (a
    :class:`fxckpt.solver.search.Found`, or ``None`` when none fits): the search over every
    segmentation with no limit on its work or states."""
    from fxckpt.solver.bounds import Limits
    from fxckpt.solver.moves import Space
    from fxckpt.solver.search import search

    found = search(problem.index, Space(exact=True), target,
                   limits=Limits(states=2**62, work=2**62))
    assert found is None or found.exact
    return found


def exact(graph: str, fraction: float) -> Row:
    """The cheapest plan of segments for ``graph`` at ``fraction``: the search over every
    segmentation with no limit on its work or states (run in a subprocess by :func:`run`)."""
    problem, target = problem_for(graph, fraction)
    start = time.perf_counter()
    found = exact_optimum(problem, target)
    return {"exact_cost": None if found is None else found.cost,
            "exact_s": time.perf_counter() - start, "exact_rss_bytes": _status("VmHWM:")}


def measure(graph: str, fraction: float, repeats: int = 3) -> Row:
    """Time, memory and the plan's gap for ``graph`` (run in a subprocess by :func:`run`)."""
    from fxckpt.solver.portfolio import solve_plan
    from fxckpt.solver import BudgetInfeasible, simulate

    make = _maker(graph)
    problem = make()[0]
    target = _target(problem, fraction)

    def solve() -> Row:
        problem, offered, blocks = make()
        start = time.perf_counter()
        try:
            sel = solve_plan(problem, target, blocks, offered, [])
        except BudgetInfeasible as e:
            return {"solve_s": time.perf_counter() - start, "infeasible": e.min_budget}
        took = time.perf_counter() - start
        fits = simulate(problem, sel.segments, sel.keep).peak_bytes <= target
        bound = sel.bound
        return {"solve_s": took, "cost": sel.recompute_cost, "fits": fits,
                "lower_bound": bound.lower_bound if bound else None,
                "gap": bound.gap(sel.recompute_cost) if bound else None,
                "gave_up": [bound.work, bound.states] if bound else None}

    runs = [solve() for _ in range(repeats)]
    row = dict(sorted(runs, key=lambda r: r["solve_s"])[len(runs) // 2])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    tracemalloc.start()
    solve()
    row["traced_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    row.update(status="ok", graph=graph, fraction=fraction, ops=len(problem.ops),
               rss_growth_bytes=max(0, _status("VmHWM:") - before),
               solve_samples=[r["solve_s"] for r in runs])
    if "cost" in row:
        row.update(_fast_alone(solve, repeats))
    return row


def _fast_alone(solve: Callable[[], Row], repeats: int) -> Row:
    """The same solves without the search over every segment (``WIDE_LIMIT`` 0): the baseline
    the plan is compared with, in the same process and at the same prices."""
    # The module: the package's attribute of that name is the function solve.
    module: Any = importlib.import_module("fxckpt.solver.solve")
    limit = module.WIDE_LIMIT
    module.WIDE_LIMIT = 0
    try:
        runs = [solve() for _ in range(repeats)]
    finally:
        module.WIDE_LIMIT = limit
    mid = sorted(runs, key=lambda r: r["solve_s"])[len(runs) // 2]
    return {"fast_cost": mid.get("cost"), "fast_s": mid["solve_s"]}


def run(graphs: Sequence[str], repeats: int = 3, timeout: float = 600.0,
        exact_timeout: float = EXACT_TIMEOUT) -> list[Row]:
    """:func:`measure` each graph in its own subprocess, and :func:`exact` those of
    :data:`EXACT_GRAPHS` in another."""
    from fxckpt.measure import MeasureError, run_in_subprocess

    rows = []
    for graph in graphs:
        args = {"graph": graph, "fraction": GRAPHS[graph]}
        try:
            rows.append(run_in_subprocess("benchmarks.solver_graphs:measure",
                                          dict(args, repeats=repeats), mmap_threshold=None,
                                          timeout=timeout))
        except (MeasureError, OSError, TimeoutError) as e:
            rows.append({"status": "error", "graph": graph, "error": _last_line(e)})
        if graph in EXACT_GRAPHS and rows[-1].get("status") == "ok":
            try:
                rows[-1].update(run_in_subprocess("benchmarks.solver_graphs:exact", args,
                                                  mmap_threshold=None, timeout=exact_timeout))
            except (MeasureError, OSError, TimeoutError) as e:
                rows[-1]["exact_error"] = _last_line(e)
        print(f"{graph}: {_row_text(rows[-1])}", flush=True)
    return rows


def _last_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or ["no output"])[-1][:300]


def _row_text(row: Row) -> str:
    if row.get("status") != "ok":
        return f"error: {row.get('error')}"
    if "infeasible" in row:
        return f"{row['solve_s']:.2f} s, infeasible (smallest peak {row['infeasible']} B)"
    gap = "exact pass" if row["gap"] is None else f"gap {row['gap']:.1%}"
    text = f"{row['solve_s']:.2f} s, {row['traced_bytes'] / 2**20:.0f} MiB traced, {gap}"
    if row.get("exact_cost"):
        text += f", {row['cost'] / row['exact_cost']:.3f}x the optimum"
    if row.get("fast_cost"):
        text += f", {row['cost'] / row['fast_cost']:.3f}x the fast space alone"
    return text


def _machine() -> str:
    import os
    import platform
    return (f"{platform.machine()} ({os.cpu_count()} cores, shared), Python "
            f"{platform.python_version()}")


def render(rows: list[Row], checks: Sequence[Any]) -> str:
    """The markdown report: one row per graph, then the targets."""
    lines = [
        "# The solver where many values stay live", "",
        "Written by `python -m benchmarks.solver_graphs` (see its docstring for the graphs) "
        f"on {_machine()}. Before the solver's work was bounded (issue 33), `lstm-16` planned "
        "in 5-16 s, `lstm-20` in 72-109 s and 1.9 GiB, `lstm-24` and `mlp-mix-24` ran out of "
        "memory. **solve s**: median wall time of `fxckpt.solver.portfolio.solve_plan`, each "
        "on a fresh problem. **traced MiB**: peak of Python "
        "allocations during one more solve (`tracemalloc`); **RSS MiB**: growth of the peak "
        "RSS over it. **gave up**: the exact search's work and states at one cut when it gave up "
        "(`fxckpt/solver/bounds.py`). **gap**: at most this share of the plan's recompute cost "
        "could be saved by any plan the search considers (a relaxed search's lower bound; over "
        "every segmentation for graphs of up to 200 ops, `WIDE_LIMIT` in "
        "`fxckpt/solver/solve.py`); the plan notes say it. **optimum**: the cheapest plan of "
        "segments, from the search over every segmentation with no limit on its work "
        f"(`exact`, {EXACT_TIMEOUT:.0f} s at most; its time and peak RSS), and the plan's cost "
        "over it. **fast space alone**: the same solves without the search over every segment "
        "(`WIDE_LIMIT` 0), in the same process: recompute cost, the plan's cost over it, and the "
        "median solve time.", "",
        "| graph | ops | budget | solve s | traced MiB | RSS MiB | gave up | recompute cost "
        "| lower bound | gap | fits | optimum | plan / optimum | fast space alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('graph')} | error: {r.get('error')} | | | | | | | | | | | | |")
            continue
        gave = f"{r['gave_up'][0]:,} / {r['gave_up'][1]}" if r.get("gave_up") else "—"
        if "infeasible" in r:
            tail = f"infeasible: smallest peak {r['infeasible']:,} B | — | — | — | — | — | — |"
        else:
            gap = "—" if r["gap"] is None else f"{r['gap']:.1%}"
            low = "—" if r["lower_bound"] is None else f"{r['lower_bound']:.4g}"
            tail = (f"{r['cost']:.4g} | {low} | {gap} | {'yes' if r['fits'] else 'NO'} | "
                    f"{_optimum(r)} | {_fast(r)} |")
        lines.append(
            f"| {r['graph']} | {r['ops']} | {r['fraction']:g} | {r['solve_s']:.2f} | "
            f"{r['traced_bytes'] / 2**20:.1f} | {r['rss_growth_bytes'] / 2**20:.1f} | {gave} | "
            + tail)
    lines += ["", "## Targets", ""]
    lines += [f"- **{c.verdict}** {c.target}: {c.subject}: {c.detail}" for c in checks]
    return "\n".join(lines) + "\n"


def _fast(row: Row) -> str:
    if not row.get("fast_cost"):
        return "—"
    return (f"{row['fast_cost']:.4g}: plan {row['cost'] / row['fast_cost']:.3f}x, "
            f"{row['fast_s']:.2f} s")


def _optimum(row: Row) -> str:
    """The optimum's cells: cost (time, RSS) and the plan's cost over it."""
    if row.get("exact_cost"):
        return (f"{row['exact_cost']:.4g} ({row['exact_s']:.0f} s, "
                f"{row['exact_rss_bytes'] / 2**30:.1f} GiB) | "
                f"{row['cost'] / row['exact_cost']:.3f}")
    if "exact_error" in row:
        return f"not found: {row['exact_error']} | —"
    return "— | —"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.solver_targets import graph_checks

    p = argparse.ArgumentParser(prog="python -m benchmarks.solver_graphs",
                                description="Time the budget solver on graphs where many "
                                "values stay live, and write solver_graphs.md / .json.")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, one solve")
    p.add_argument("--graphs", help=f"comma-separated (default: all of {', '.join(GRAPHS)})")
    p.add_argument("--repeats", type=int, default=3, help="solves per median (default 3)")
    p.add_argument("--out", type=Path, default=Path("docs"), help="output directory")
    args = p.parse_args(argv)
    graphs = args.graphs.split(",") if args.graphs else list(QUICK if args.quick else GRAPHS)
    unknown = [g for g in graphs if g not in GRAPHS]
    if unknown:
        p.error(f"unknown graph(s) {', '.join(unknown)}; choose from {', '.join(GRAPHS)}")
    rows = run(graphs, 1 if args.quick else args.repeats)
    checks = graph_checks(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "solver_graphs.md").write_text(render(rows, checks))
    (args.out / "solver_graphs.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(c.passed is not False for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())

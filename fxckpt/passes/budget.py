"""Budget selection and memory prediction: node runs <-> the solver's op ranges.

Every plan gets a predicted peak from the simulator (:mod:`fxckpt.solver.simulate`), so
``fxckpt.inspect(tm).plan`` reports one number for every strategy. With ``budget=``, the solver
(:mod:`fxckpt.solver.budget`) chooses the op ranges with the least recompute whose predicted peak
fits; they become node runs here, and go through the same clean-up as every other strategy.

The simulator counts tensors, not the short-lived temporaries of backward kernels (a gradient
being scaled, a weight gradient before it is added into ``.grad``). A *reserve* the size of the
largest single gradient stands for them: the predicted peak is the simulated peak plus the
reserve, and the solver plans for the budget minus the reserve.
"""

from __future__ import annotations

import dataclasses
import logging
import itertools
import time
from typing import Callable, Optional, Sequence

import torch

import torch.fx

from fxckpt.budget import Budget, BudgetInfeasibleError
from fxckpt.passes.graph_view import SYNTHETIC
from fxckpt.plan import Segment, format_bytes
from fxckpt.solver import BudgetInfeasible, Problem, Segments, min_feasible_peak, simulate, solve

__all__ = ["solve_runs", "to_segments", "Prediction", "predict", "reserve", "choose_actions",
           "measure_rates", "offload_cost_per_byte", "device_of"]

log = logging.getLogger(__name__)

Run = list[torch.fx.Node]


def to_segments(problem: Problem, runs: Sequence[Run]) -> Segments:
    """Op ranges of node runs (a run starts at its first node's synthetic op when it has one)."""
    position = {op.name: i for i, op in enumerate(problem.ops)}
    segments = []
    for run in runs:
        start = position[run[0].name]
        if start > 0 and problem.ops[start - 1].name == run[0].name + SYNTHETIC:
            start -= 1
        segments.append((start, position[run[-1].name] + 1))
    return tuple(segments)


def to_runs(problem: Problem, segments: Segments, order: Sequence[torch.fx.Node]) -> list[Run]:
    by_name = {n.name: n for n in order}
    runs = []
    for start, end in segments:
        run = [by_name[op.name] for op in problem.ops[start:end] if op.name in by_name]
        if run:
            runs.append(run)
    return runs


def reserve(problem: Problem) -> int:
    """Bytes set aside for backward temporaries: the largest single gradient."""
    return max((op.gradient_bytes for op in problem.ops), default=0)


class Prediction:
    """Predicted peak and recompute cost of a set of runs, and the eager peak, in bytes/cost units."""

    def __init__(self, problem: Problem, runs: Sequence[Run]) -> None:
        ranges = to_segments(problem, runs)
        sim = simulate(problem, ranges)
        extra = reserve(problem)
        self.peak = sim.peak_bytes + extra
        self.recompute = sum(problem.index.segment_cost(a, b) for a, b in ranges)  # offload-aware
        self.eager_peak = simulate(problem, ()).peak_bytes + extra


def predict(problem: Problem, runs: Sequence[Run]) -> Prediction:
    return Prediction(problem, runs)


def solve_runs(problem: Problem, order: Sequence[torch.fx.Node], budget: Budget) -> tuple[list[Run], int]:
    """Runs with the least recompute whose predicted peak fits ``budget``; and the budget in bytes."""
    extra = reserve(problem)
    eager = simulate(problem, ()).peak_bytes + extra
    limit = budget.resolve(eager)
    if limit <= extra:
        raise _infeasible(budget, limit, min_feasible_peak(problem) + extra, eager)
    try:
        solution = solve(problem, limit - extra)
    except BudgetInfeasible as e:
        raise _infeasible(budget, limit, e.min_budget + extra, eager) from e
    log.info("budget %s (%s): %d segment(s), predicted peak %s, recompute cost %.3g",
             budget, format_bytes(limit), len(solution.segments), format_bytes(solution.predicted_peak + extra),
             solution.recompute_cost)
    return to_runs(problem, solution.segments, order), limit


def _infeasible(budget: Budget, limit: int, minimum: int, eager: int) -> BudgetInfeasibleError:
    fraction = f" ({minimum / eager:.3f} of the eager peak)" if eager else ""
    return BudgetInfeasibleError(
        f"budget {budget} = {format_bytes(limit)} ({limit} bytes) cannot be met: the smallest peak "
        f"activation memory any plan reaches for this model and input is {format_bytes(minimum)} "
        f"({minimum} bytes){fraction}; the unmodified model's is {format_bytes(eager)}. Give "
        f"budget >= {minimum}, or a smaller batch",
        min_budget=minimum, budget=limit,
    )


RATE_REPEATS = 3
"""Timings per rate after the warm-up run (which is discarded); the median is kept."""

_RATES: dict[tuple[torch.device, torch.device], tuple[float, float]] = {}


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes on ``device`` (CUDA work is waited for on both sides)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return max(time.perf_counter() - start, 1e-9)


def _median_after_warmup(fn: Callable[[], object], device: torch.device) -> float:
    times = [_timed(fn, device) for _ in range(RATE_REPEATS + 1)][1:]  # the first run warms up
    return sorted(times)[len(times) // 2]


def measure_rates(device: torch.device | str = "cpu",
                  host: torch.device | str = "cpu") -> tuple[float, float]:
    """(FLOP/s of a matmul on ``device``, bytes/s of a copy from ``device`` to ``host``), roughly:
    each the median of :data:`RATE_REPEATS` timings after a discarded warm-up run."""
    device, host = torch.device(device), torch.device(host)
    n = 256 if device.type == "cpu" else 2048
    a = torch.randn(n, n, device=device)
    flops = 2 * n**3 / _median_after_warmup(lambda: a @ a, device)
    nbytes = 1 << (22 if device.type == "cpu" else 25)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pin = host.type == "cpu" and device.type == "cuda"
    dst = torch.empty(nbytes, dtype=torch.uint8, device=host, pin_memory=pin)
    copy = _median_after_warmup(lambda: dst.copy_(src, non_blocking=pin), device)
    return flops, nbytes / copy


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model`` computes: its first parameter's (or buffer's) device, else the CPU."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def offload_cost_per_byte(bandwidth: Optional[float], device: torch.device | str = "cpu",
                          host: torch.device | str = "cpu") -> float:
    """FLOP-equivalents of moving one saved byte from ``device`` to ``host`` and back, at
    ``bandwidth`` B/s (measured when ``None``), priced in the same units as recomputation (a
    matmul rate measured on ``device``). Rates are measured once per (device, host) and process,
    so every plan is priced alike."""
    key = (torch.device(device), torch.device(host))
    if key not in _RATES:
        _RATES[key] = measure_rates(*key)
    flops_rate, measured_bw = _RATES[key]
    return 2.0 * flops_rate / (bandwidth or measured_bw)


def choose_actions(problem: Problem, segments: Sequence[Segment], runs: Sequence[Run],
                   notes: list[str]) -> tuple[Segment, ...]:
    """Each segment's action: offload when the problem's offload price beats recomputing it.

    The solver already priced every segment at the cheaper of the two (``Problem``'s
    ``offload_cost_per_byte``), so the segments it chose are the cheapest plan under the budget
    with three states per op: kept, recomputed, or kept with its saved tensors offloaded.
    """
    ranges = to_segments(problem, runs)
    chosen = tuple(
        dataclasses.replace(seg, action="offload" if problem.index.segment_offloads(a, b) else "recompute")
        for seg, (a, b) in zip(segments, ranges)
    )
    moved = sum(s.action == "offload" for s in chosen)
    notes.append(f"offload='auto': {moved} of {len(chosen)} segment(s) offload, the rest recompute "
                 f"(moving a byte costs {problem.offload_cost_per_byte:.3g} FLOP-equivalents)")
    return chosen

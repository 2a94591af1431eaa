"""What runs inside the benchmark's subprocesses: one configuration each, JSON out.

``measure_memory`` runs under ``MALLOC_MMAP_THRESHOLD_`` (set by
:func:`fxckpt.measure.run_in_subprocess`): warm-up step (compiles, for ``torch.compile``), then
the RSS protocol over ``repeats`` steps, then one step under the live-tensor tracker.
``measure_time`` runs with glibc's default allocator and times the method and a deep copy of
the unmodified model by turns in the same process, so the ratio sees the same machine load.
``solve_scaling`` times the budget solver alone on GPT-2 graphs of growing depth.

Every function catches what goes wrong with the method and returns it as
``{"status": "error", "error": ...}`` (or ``"infeasible"``, ``"n/a"``): one peer failing never
stops the benchmark.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any, Callable, Optional

import torch

from benchmarks.methods import (COMPILE_BACKEND, COMPILED, Budget, NotApplicable, prepare,
                                  solve_seconds)
from benchmarks.models import ModelSpec, spec_for
from fxckpt.measure import error_text, step_memory, time_by_turns, training_step

__all__ = ["measure_memory", "measure_time", "solve_scaling", "error_text"]

Result = dict[str, Any]


def _setup(
    model: str, quick: bool
) -> tuple[ModelSpec, torch.nn.Module, tuple[Any, ...], Callable[[Any], Any]]:
    torch.set_num_threads(1)
    spec = spec_for(model)
    torch.manual_seed(0)
    built, inputs, loss = spec.build(spec.quick if quick else spec.full)
    return spec, built, inputs, loss


def _failure(e: BaseException) -> Result:
    from fxckpt.budget import BudgetInfeasibleError

    if isinstance(e, NotApplicable):
        return {"status": "n/a", "error": str(e)}
    if isinstance(e, BudgetInfeasibleError):
        return {"status": "infeasible", "error": error_text(e), "min_budget": e.min_budget}
    return {"status": "error", "error": error_text(e)}


def measure_memory(
    model: str,
    method: str,
    budget: Optional[Budget] = None,
    quick: bool = False,
    repeats: int = 3,
    compile_backend: str = COMPILE_BACKEND,
    time_solver: bool = True,
) -> Result:
    """Peak activation memory of one step: RSS protocol (median) and live-tensor tracker."""
    spec, built, inputs, loss = _setup(model, quick)
    try:
        module, facts = prepare(method, built, inputs, spec, budget, compile_backend, time_solver,
                                loss=loss)
        memory = step_memory(training_step(module, inputs, loss), repeats,
                             tracked=method not in COMPILED)
    except Exception as e:  # noqa: BLE001 - any failure of a method is a result to report
        return _failure(e)
    rss = {k: memory.pop(k) for k in ("rss_bytes", "rss_samples")}
    return {"status": "ok", **rss, **facts, **(_UNTRACKABLE if method in COMPILED else memory)}


_UNTRACKABLE = {"tracked_bytes": None, "tracked_error": (
    "not measured: under a TorchDispatchMode dynamo skips the compiled frame and the step runs "
    "eagerly, so the tracker would count the unmodified model")}


def measure_time(model: str, method: str, budget: Optional[Budget] = None, quick: bool = False,
                 repeats: int = 5, compile_backend: str = COMPILE_BACKEND,
                 time_solver: bool = False, groups: int = 1,
                 peer: Optional[list[Any]] = None) -> Result:
    """Median step seconds of the method and of the unmodified model, timed by turns.

    ``groups`` x ``repeats`` pairs of steps are timed, alternating method and baseline; with
    ``groups > 1``, ``group_ratios`` gives the ratio of medians of each group of ``repeats`` pairs
    (the protocol of one row's ratio, repeated): for the unmodified model against its own copy
    their spread is the timing noise (:func:`benchmarks.targets.timing_noise`).
    ``time_solver`` is accepted so that memory and time children take the same arguments; the
    time child never times the solver. ``peer`` = ``[method, budget]``: that method too is
    timed by turns with the two (on its own copy of the model), for ``peer_ratio``, the method's
    median step over the peer's, free of the drift between two children's baselines.
    """
    spec, built, inputs, loss = _setup(model, quick)
    baseline = copy.deepcopy(built)
    steps: dict[str, Callable[[], Any]] = {}
    try:
        if peer is not None:
            theirs, _ = prepare(peer[0], copy.deepcopy(built), inputs, spec, peer[1],
                                compile_backend, time_solver=False, loss=loss)
            steps["peer"] = training_step(theirs, inputs, loss)
        module, _ = prepare(
            method, built, inputs, spec, budget, compile_backend, time_solver=False, loss=loss
        )
        steps.update(method=training_step(module, inputs, loss),
                     base=training_step(baseline, inputs, loss))
        samples = time_by_turns(steps, groups * repeats)
    except Exception as e:  # noqa: BLE001
        return _failure(e)
    method_s, base_s = statistics.median(samples["method"]), statistics.median(samples["base"])
    chunks = [slice(g * repeats, (g + 1) * repeats) for g in range(groups)]
    median = statistics.median
    result = {
        "status": "ok",
        "step_s": method_s,
        "base_step_s": base_s,
        "time_ratio": method_s / base_s,
        "step_samples": samples["method"],
        "base_samples": samples["base"],
    }
    if peer is not None:
        peer_s = statistics.median(samples["peer"])
        result.update(peer_step_s=peer_s, peer_ratio=method_s / peer_s,
                      peer_samples=samples["peer"])
    if groups > 1:
        result["group_ratios"] = [median(samples["method"][c]) / median(samples["base"][c])
                                  for c in chunks]
    return result


def solve_scaling(layers: list[int], budgets: list[float], repeats: int = 3) -> Result:
    """The budget solver's wall time on GPT-2 graphs with each layer count (tiny width:
    the graph's size is what the solver's time depends on). Pure Python: threads do not matter,
    and it also runs inside the test process, whose settings it must leave alone."""
    sizes = {"width": 32, "heads": 2, "vocab": 64, "batch": 2, "seq": 32}
    rows: list[Result] = []
    for n in layers:
        torch.manual_seed(0)
        built, inputs, _ = spec_for("gpt2").build(dict(sizes, layers=n))
        try:
            rows += [
                {"layers": n, "status": "ok", **r}
                for r in solve_seconds(built, inputs, budgets, repeats)
            ]
        except Exception as e:  # noqa: BLE001
            rows.append({"layers": n, "status": "error", "error": error_text(e)})
    return {"status": "ok", "rows": rows, "sizes": sizes}

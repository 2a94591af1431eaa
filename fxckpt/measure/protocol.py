"""Honest memory and time measurement for a training step on a machine without a GPU.

A CPU has no ``torch.cuda.max_memory_allocated``. Two independent measures stand in for it, and
each checks the other:

* **RSS protocol** (what the operating system saw). glibc keeps small freed blocks in its heap,
  so resident memory normally never goes down and its high-water mark says little about one step.
  With ``MALLOC_MMAP_THRESHOLD_=65536`` every allocation of 64 KiB or more gets its own ``mmap``
  and goes back to the OS when freed, so resident memory follows the tensors. The variable is
  read once at process start, hence a fresh subprocess per configuration::

      child (MALLOC_MMAP_THRESHOLD_=65536):  import, build, warm up
          write '5' to /proc/self/clear_refs      # VmHWM := VmRSS
          before = VmRSS;  step();  peak = VmHWM
          peak activation = peak - before          # median of several steps
      child prints its result as JSON on its last stdout line; the parent parses it

* **LiveTensorTracker** (what the tensors held). A ``TorchDispatchMode`` sees every op, in
  forward and in backward (including checkpoint recomputation), counts the storage each new
  output owns, and subtracts it when the storage is freed. It is exact, allocator-independent,
  and blind to allocator overhead and Python objects; a kernel's own scratch space it adds
  when asked (:mod:`fxckpt.cost.scratch`).

Time steps in a process *without* the variable: an ``mmap`` per tensor makes every step fault its
pages in again (1.6x slower with one thread here, several times slower with two). Absolute step
times on a shared machine are noise; report medians and ratios against a baseline measured in
the same run (:func:`time_by_turns`).

The benchmark's children (:mod:`benchmarks.child`) and the demo (:mod:`fxckpt.cli.demo`) measure
with the same helpers: :func:`training_step`, :func:`step_memory`, :func:`time_by_turns`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from fxckpt.checks import check_int
from fxckpt.errors import MeasureError
from fxckpt.measure.tracker import LiveTensorTracker, Scratch

__all__ = [
    "LiveTensorTracker",
    "MeasureError",
    "MMAP_THRESHOLD",
    "read_status",
    "reset_peak_rss",
    "step_peak_rss",
    "step_peak_tracked",
    "time_step",
    "training_step",
    "step_memory",
    "time_by_turns",
    "error_text",
    "run_in_subprocess",
    "calibrate_rss",
]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 65536
"""Bytes from which glibc serves (and returns) each allocation with its own ``mmap``."""


def step_peak_tracked(fn: Callable[[], Any], warmup: int = 1, repeats: int = 1, *,
                      scratch: Optional[Scratch] = None) -> dict[str, Any]:
    """Median peak of live tensor bytes of ``fn()``, by :class:`LiveTensorTracker` (``scratch``:
    kernels' own buffers added while they run, as verification counts them:
    :func:`fxckpt.cost.scratch.call_scratch`)."""
    check_int("repeats", repeats)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        gc.collect()
        with LiveTensorTracker(scratch=scratch) as tracker:
            fn()
        samples.append(tracker.peak_bytes)
    return {"peak_bytes": int(statistics.median(samples)), "samples": samples}


def read_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process from ``/proc/self/status``, in bytes."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise MeasureError(
            f"cannot read /proc/self/status ({e}); the RSS protocol needs Linux"
        ) from e
    status = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            status[key] = int(value.split()[0]) * 1024  # reported in kB
    return status


def reset_peak_rss() -> int:
    """Reset this process's ``VmHWM`` to its current ``VmRSS`` (Linux >= 4.0); returns ``VmRSS``.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise MeasureError(f"cannot reset the RSS peak via /proc/self/clear_refs ({e})") from e
    status = read_status()
    if status["VmHWM"] > status["VmRSS"] + 2**20:
        raise MeasureError(
            f"writing '5' to /proc/self/clear_refs did not reset VmHWM "
            f"({status['VmHWM']} bytes, VmRSS {status['VmRSS']}); this kernel is too old"
        )
    return status["VmRSS"]


def step_peak_rss(fn: Callable[[], Any], warmup: int = 1, repeats: int = 3) -> dict[str, Any]:
    """Median peak resident memory added by ``fn()``: ``VmHWM`` during it minus ``VmRSS`` before.

    Honest only in a process started with ``MALLOC_MMAP_THRESHOLD_`` set (see
    :func:`run_in_subprocess`); without it freed memory is not returned and steps look free.
    """
    check_int("repeats", repeats)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        log.warning("MALLOC_MMAP_THRESHOLD_ is not set: freed memory stays resident and the RSS "
                    "peak understates the step; measure through run_in_subprocess")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        gc.collect()
        before = reset_peak_rss()
        fn()
        samples.append(read_status()["VmHWM"] - before)
    return {
        "peak_bytes": int(statistics.median(samples)),
        "samples": samples,
        "rss_before": before,
    }


def time_step(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    check_int("repeats", repeats)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_step(module: Callable[..., Any], inputs: Sequence[Any],
                  loss: Callable[[Any], torch.Tensor]) -> Callable[[], None]:
    """``step()``: forward ``module(*inputs)``, ``loss`` of its output, backward.

    Gradients accumulate from step to step: they are allocated in the warm-up step and are not
    part of any later step's peak.
    """
    def step() -> None:
        loss(module(*inputs)).backward()

    return step


def step_memory(step: Callable[[], Any], repeats: int = 3, *,
                tracked: bool = True) -> dict[str, Any]:
    """Peak activation memory of ``step()``: the RSS protocol over ``repeats`` steps after one
    warm-up step (``rss_bytes``, ``rss_samples``), then, unless ``tracked`` is false, one step
    under :class:`LiveTensorTracker` (``tracked_bytes``). The tracker is a cross-check: when it
    fails, ``tracked_bytes`` is ``None`` and ``tracked_error`` says why."""
    rss = step_peak_rss(step, warmup=1, repeats=repeats)
    result: dict[str, Any] = {"rss_bytes": rss["peak_bytes"], "rss_samples": rss["samples"]}
    if tracked:
        try:
            result["tracked_bytes"] = step_peak_tracked(step, warmup=0, repeats=1)["peak_bytes"]
        except Exception as e:  # noqa: BLE001 - RSS stands without the cross-check
            result.update(tracked_bytes=None, tracked_error=error_text(e))
    return result


def time_by_turns(steps: Mapping[str, Callable[[], Any]],
                  repeats: int = 3, settle: int = 1) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` over ``repeats`` rounds, after one warm-up call of each.

    Every round times each step once, in turn, so a change in the machine's load hits all of
    them alike and their ratios stay meaningful on a shared machine. Each timed call follows
    ``settle`` untimed calls of the same step: a step right after one that held less memory
    first faults in the pages the allocator gave back in between (on this CPU an unmodified
    Llama step after a checkpointed one took 7,800 page faults and 8% longer), which no
    training loop, repeating one step, pays.
    """
    check_int("repeats", repeats)
    check_int("settle", settle, low=0)
    for step in steps.values():
        step()  # warm-up (and compilation, for torch.compile)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(time_step(step, repeats=1, warmup=settle))
    return samples


def error_text(e: BaseException, limit: int = 600) -> str:
    """``Type: message`` of an exception, cut to ``limit`` characters."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_in_subprocess(
    target: str,
    kwargs: dict[str, Any],
    *,
    mmap_threshold: Optional[int] = MMAP_THRESHOLD,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` in a fresh process.

    The child gets this process's ``sys.path`` and ``MALLOC_MMAP_THRESHOLD_=mmap_threshold``
    (``None``: glibc's default allocator, which is what to time steps with: an ``mmap`` per
    tensor makes every step page-fault). ``target`` must return a JSON-able dict, which the
    child prints as its last stdout line.
    """
    module, _, function = target.partition(":")
    if not module or not function:
        raise ValueError(f"target must look like 'package.module:function' (got {target!r})")
    child = "from fxckpt.measure.protocol import _child_main; _child_main()"
    cmd = [sys.executable, "-c", child, target, json.dumps(kwargs)]
    log.debug("running %s(%s) in a subprocess", target, kwargs)
    proc = subprocess.run(
        cmd, env=_child_env(mmap_threshold), capture_output=True, text=True, timeout=timeout
    )
    return _parse_result(target, proc)


def _parse_result(target: str, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise MeasureError(f"{target} failed in its subprocess (exit code {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        raise MeasureError(f"{target} must return a JSON-able dict; its subprocess printed "
                           f"{lines[-1][:200]!r} last")
    return result


def _child_env(mmap_threshold: Optional[int]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
    )
    return env


def _child_main() -> None:
    """Entry point of the measuring subprocess: ``argv = [target, json kwargs]``."""
    import importlib

    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    module, _, function = target.partition(":")
    result = getattr(importlib.import_module(module), function)(**kwargs)
    if not isinstance(result, dict):
        raise TypeError(f"{target} must return a JSON-able dict (got {type(result).__name__})")
    sys.stdout.flush()
    print("\n" + json.dumps(result), flush=True)


def calibrate_rss(mib: int = 64) -> dict[str, Any]:
    """Measure a step that allocates and fills one ``mib`` MiB tensor: checks the RSS protocol.

    Run it through ``run_in_subprocess("fxckpt.measure:calibrate_rss", {"mib": 64})``; its
    ``peak_bytes`` should be close to ``expected_bytes``.
    """
    def step() -> None:
        t = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        del t

    result = step_peak_rss(step, warmup=1, repeats=3)
    result["expected_bytes"] = mib * 2**20
    return result

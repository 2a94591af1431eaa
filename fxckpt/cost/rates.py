"""Machine rates that price offloading against recomputation, measured once per process.

``offload="auto"`` lets the solver move a segment's saved tensors to host memory instead of
recomputing it when that is cheaper. Both prices must be in one unit: the FLOP-equivalents the
cost model uses (:mod:`fxckpt.cost.bridge`). So the matmul rate of the model's device and
the copy bandwidth to the host are timed here — after a discarded warm-up run, the median of a
few runs — and a byte moved costs ``2 * matmul rate / bandwidth`` FLOP-equivalents (out and back).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Optional

import torch

__all__ = ["measure_rates", "device_of", "offload_cost_per_byte", "timed", "fastest",
           "RATE_REPEATS"]

RATE_REPEATS = 3
"""Timings per rate after the warm-up run (which is discarded); the median is kept."""

_RATES: dict[tuple[torch.device, torch.device], tuple[float, float]] = {}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes on ``device`` (CUDA work is waited for on both sides)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return max(time.perf_counter() - start, 1e-9)


def fastest(fn: Callable[[], object], device: torch.device | str = "cpu",
            repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed runs of ``fn`` after a warm-up run (CUDA waited for):
    what else runs on the machine only ever adds time."""
    device = torch.device(device)
    fn()
    return min(timed(fn, device) for _ in range(repeats))


def _median_after_warmup(fn: Callable[[], object], device: torch.device) -> float:
    times = [timed(fn, device) for _ in range(RATE_REPEATS + 1)][1:]  # the first run warms up
    return sorted(times)[len(times) // 2]


def measure_rates(device: torch.device | str = "cpu",
                  host: torch.device | str = "cpu") -> tuple[float, float]:
    """(FLOP/s of a matmul on ``device``, bytes/s of a copy from ``device`` to ``host``), roughly:
    each the median of :data:`RATE_REPEATS` timings after a discarded warm-up run."""
    device, host = torch.device(device), torch.device(host)
    n = 256 if device.type == "cpu" else 2048
    a = torch.full((n, n), 0.5, device=device)  # values do not matter; no generator is drawn
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
    so every plan is priced alike, and the price is rounded to a power of two: timings on one
    machine vary by 10-20% from run to run, which must not change the plan a model gets."""
    key = (torch.device(device), torch.device(host))
    if key not in _RATES:
        _RATES[key] = measure_rates(*key)
    flops_rate, measured_bw = _RATES[key]
    return 2.0 ** round(math.log2(2.0 * flops_rate / (bandwidth or measured_bw)))

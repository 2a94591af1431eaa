"""The wall time of checkpointed segments' forward runs, while a clock is on.

A plan prices each segment's forward before it ever runs (:mod:`fxckpt.cost`); the clock
measures what one actually takes inside a training step, so that the serving layer can refine
the prices after a few steps (:mod:`fxckpt.serve.refine`). It is off unless a caller turns it
on for a call (:func:`timing`); :func:`fxckpt.runtime.checkpoint.checkpoint` then times each
segment's first run (never its recompute) and notes the price the plan gave it
(``SegmentModule.forward_cost``).

On a CUDA device the run is bracketed by two events on the current stream, read only when the
times are asked for (one synchronisation then, none during the step); on a CPU by
``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from typing import Any, Iterator, Optional

import torch

__all__ = ["SegmentClock", "Timed", "timing", "running_clock"]


@dataclasses.dataclass(frozen=True)
class Timed:
    """What a clock measured: the segments' forward runs it saw."""

    runs: int
    """Forward runs of checkpointed segments timed."""
    seconds: float
    """Their wall time, summed."""
    cost: float
    """What the plans priced them at, summed (FLOP-equivalents, the plans' own units)."""


class SegmentClock:
    """Times the forward runs of checkpointed segments while on (see :func:`timing`)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._cost = 0.0
        self._runs = 0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def run(self, segment: torch.nn.Module, device: Optional[torch.device]) -> Iterator[None]:
        """Time one forward run of ``segment`` (on ``device``'s clock: CUDA events or the
        CPU's)."""
        cost = float(getattr(segment, "forward_cost", 0.0))
        if device is not None and device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - begin
        self._runs += 1
        self._cost += cost

    def timed(self) -> Timed:
        """What was measured so far (waits for the CUDA events it holds)."""
        if self._events:
            torch.cuda.synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events = []
        return Timed(self._runs, self._seconds, self._cost)


_CLOCK: contextvars.ContextVar[Optional[SegmentClock]] = contextvars.ContextVar(
    "fxckpt_segment_clock", default=None)


@contextlib.contextmanager
def timing(clock: SegmentClock) -> Iterator[None]:
    """Segments checkpointed in this context are timed by ``clock``."""
    token = _CLOCK.set(clock)
    try:
        yield
    finally:
        _CLOCK.reset(token)


def running_clock() -> Optional[SegmentClock]:
    """The clock turned on for this call, if any."""
    return _CLOCK.get()

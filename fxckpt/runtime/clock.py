"""The wall time of checkpointed segments' forward runs, and of a training call's two passes.

A plan prices each segment's forward before it ever runs (:mod:`fxckpt.cost`); the clock
measures what one actually takes inside a training step, so that the serving layer can refine
the prices after a few steps (:mod:`fxckpt.serve.refine`). It is off unless a caller turns it
on for a call (:func:`timing`); :func:`fxckpt.runtime.checkpoint.checkpoint` then times each
segment's first run (never its recompute) and notes the price the plan gave it
(``SegmentModule.forward_cost``).

A :class:`PassClock` times a whole training call the same way: its forward, and the backward
that runs through its outputs, so that the serving layer can tell a step's time apart from what
its plan adds to it.

On a CUDA device a run is bracketed by two events on the current stream, read only when the
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

__all__ = ["SegmentClock", "PassClock", "Timed", "timing", "running_clock"]


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


class PassClock:
    """Times one training call: its forward, and the backward that runs through its outputs.

    The forward is the call itself, from :meth:`start` to the outputs it is shown (:meth:`saw`).
    The backward starts when the first gradient reaches one of those outputs and
    ends when the autograd engine finishes that backward (a callback the engine runs at its end),
    so it includes the recompute of every segment and the gradients' accumulation, and the
    backward of a loss computed outside the module is left out. The span runs from the call's
    start to that end: the step as the training loop runs it, the loss and whatever the loop
    does before its backward included. No backward through the outputs (none requires grad, or
    the step never calls one): :meth:`seconds` gives ``None`` for it and for the span.
    """

    def __init__(self, device: Optional[torch.device]) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._forward: Optional[tuple[Any, Any]] = None
        self._backward: Optional[tuple[Any, Any]] = None
        self._start: Any = None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """The call begins."""
        self._start = self._mark()

    def saw(self, outputs: Any) -> Any:
        """The call returned ``outputs``: its forward ends, and the backward through them is
        watched. Returns ``outputs``."""
        self._forward = (self._start, self._mark())
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if not tensors:
            return outputs
        began: list[Any] = []

        def first_gradient(_grads: Any) -> None:
            if began:
                return
            began.append(self._mark())
            torch.autograd.Variable._execution_engine.queue_callback(ended)

        def ended() -> None:
            self._backward = (began[0], self._mark())
            handle.remove()

        handle = torch.autograd.graph.register_multi_grad_hook(tensors, first_gradient,
                                                               mode="any")
        return outputs

    def seconds(self) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """(forward, backward, span) seconds; ``None`` for what was not seen (waits for the
        CUDA events)."""
        span = None if self._backward is None else (self._start, self._backward[1])
        return self._elapsed(self._forward), self._elapsed(self._backward), self._elapsed(span)

    def _elapsed(self, pair: Optional[tuple[Any, Any]]) -> Optional[float]:
        if pair is None:
            return None
        begin, end = pair
        if self.cuda:
            end.synchronize()
            return float(begin.elapsed_time(end)) / 1e3
        return float(end - begin)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a call's outputs: nested containers, and dataclasses such as Hugging Face's
    outputs (pytree flattens those it knows; a plain dataclass is opened here)."""
    from torch.utils import _pytree as pytree

    found = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found

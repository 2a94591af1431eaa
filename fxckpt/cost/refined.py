"""Prices refined by a training step's own measured segment times: one factor on every op.

Prices are measured call by call, each aten call timed on its own (:mod:`fxckpt.cost.cpu_table`,
:func:`fxckpt.cost.devices.measure_profile`). Inside a training step the same calls take longer:
autograd records them, Python runs around each, and they share the cache with the rest of the
step. On the benchmark models that made every predicted CPU step 9-27% short of the measured
one (docs/step_time.md), while the fixed overheads of a segment, a kept node and a saved tensor,
measured inside checkpointed steps, were not. A plan weighs the two against each other, so an
op price too low by a common factor favours segments over keeping outputs.

The serving layer times the forward runs of the checkpointed segments for a few steps
(:mod:`fxckpt.runtime.clock`) and compares them with the prices the plan gave them
(:func:`in_step_factor`); a plan made in :func:`refined` prices every op at that factor. One
factor, not one per segment or op: a segment of a few small ops is timed at a few hundred
microseconds, where two steps' noise on a shared machine is tens of percent, and a factor per
op would make plans differ from run to run.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

__all__ = ["refined", "scale", "in_step_factor", "forward_overhead", "LIMITS", "FORWARD_SHARE"]

LIMITS = (0.25, 4.0)
"""The factor is held inside these bounds: a step slowed by something else entirely (another
process, a first call's allocation) must not turn the prices upside down."""

FORWARD_SHARE = 0.5
"""The share of a segment's fixed overhead (:attr:`fxckpt.cost.devices.DeviceProfile.segment`,
forward and backward) spent in its forward run, as its timed run includes it."""

_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("fxckpt_price_scale", default=1.0)


@contextlib.contextmanager
def refined(factor: float) -> Iterator[None]:
    """Plans made in this context price every op at ``factor`` times its price."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"a price factor must be a positive number (got {factor!r})")
    token = _SCALE.set(float(factor))
    try:
        yield
    finally:
        _SCALE.reset(token)


def scale() -> float:
    """The factor on op prices in this context (1 outside :func:`refined`)."""
    return _SCALE.get()


def forward_overhead(runs: int, segment_overhead: float) -> float:
    """Seconds of fixed overhead in ``runs`` timed forward runs of segments (:data:`FORWARD_SHARE`
    of ``segment_overhead`` each)."""
    return runs * FORWARD_SHARE * segment_overhead


def in_step_factor(seconds: float, cost: float, runs: int, unit: float,
                   segment_overhead: float) -> float:
    """How much longer the timed forward runs took than their prices say.

    ``seconds``: their measured wall time; ``cost``: their prices summed (FLOP-equivalents);
    ``runs``: how many; ``unit``: FLOP-equivalents per second; ``segment_overhead``: a segment's
    fixed overhead in seconds, :data:`FORWARD_SHARE` of which each run's time includes. The
    factor applies to the ops alone, and is held inside :data:`LIMITS`.
    """
    if runs <= 0 or cost <= 0 or unit <= 0 or seconds <= 0:
        return 1.0
    ops = max(seconds - forward_overhead(runs, segment_overhead), 0.0)
    low, high = LIMITS
    return min(max(ops * unit / cost, low), high)

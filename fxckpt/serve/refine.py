"""After the first few training steps, the plans' prices refined from measured segment times.

A budget plan weighs what recompute costs against fixed overheads (a segment's checkpoint
machinery, a kept output's bookkeeping), with op prices measured call by call when the first
plan is made. Inside a step the calls take longer than alone (:mod:`fxckpt.cost.refined`).
So a transformed module, in training:

1. runs its first :data:`WARMUP` steps as planned (the first one also captures and plans);
2. times the forward run of every checkpointed segment in the next :data:`TIMED` steps
   (:mod:`fxckpt.runtime.clock`) and compares the fastest step's time with what the plans
   priced those runs at (the fastest, as each call's price is its fastest run: a step slowed
   by another process or a one-off cost says nothing of the prices);
3. at the step after, if the factor is off 1 by more than :data:`TOLERANCE`, makes its plans
   again with every op priced at that factor: once, never again. The new plans serve from that
   step on; a plan that comes out the same changes nothing. Plans only choose what is
   recomputed, so the gradients are the same bits either way.

Only where the prices are this machine's own measurements and the plan is the solver's: a budget
(``budget=``), no named ``device_profile`` (a named profile, or ``FXCKPT_CPU_PRICES=table``,
asks for the same plan on every machine), no pipeline stages, one process (every rank of a job
must make the same plan, and each would measure its own times). A call inside
``torch.compile`` is never timed. ``fxckpt.inspect(tm).refinement`` says what was measured
and what it changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable, Iterator, Optional

import torch

from fxckpt.config import TransformConfig
from fxckpt.cost.refined import forward_overhead, in_step_factor, refined
from fxckpt.plan import Plan
from fxckpt.runtime.clock import SegmentClock, timing

__all__ = ["Refiner", "Refinement", "refines", "WARMUP", "TIMED", "TOLERANCE"]

log = logging.getLogger(__name__)

WARMUP = 1
"""Training steps run before any is timed (the first captures, plans and allocates)."""

TIMED = 3
"""Training steps whose segments are timed (the fastest counts)."""

TOLERANCE = 0.1
"""How far from 1 the measured factor must be for the plans to be made again."""


@dataclasses.dataclass
class Refinement:
    """What the timed steps measured, and what it changed (``inspect(tm).refinement``)."""

    steps: int
    """Training steps timed."""
    runs: int
    """Forward runs of checkpointed segments in the fastest of them."""
    seconds: float
    """Their measured wall time."""
    predicted: float
    """What the plans priced them at, in seconds (a segment's fixed overhead included)."""
    measured: float
    """How much longer the ops ran inside the step than priced
    (:func:`~fxckpt.cost.refined.in_step_factor`; 1 when nothing was timed)."""
    factor: float
    """The factor every op is priced at from now on: :attr:`measured`, or 1 when that is within
    :data:`TOLERANCE` of 1."""
    replanned: bool
    """Whether the plans were made again."""
    changed: Optional[bool] = None
    """Whether a plan made again differs from the one it replaced (in its segments, what they
    keep, or how they save); ``None`` until the step after the re-plan has run."""

    def __str__(self) -> str:
        if not self.runs:
            return f"no checkpointed segment ran in {self.steps} timed steps: prices unchanged"
        head = (f"the {self.runs} segment runs of the fastest of {self.steps} timed steps took "
                f"{self.seconds * 1e3:.1f} ms, priced at {self.predicted * 1e3:.1f} ms")
        if not self.replanned:
            return (f"{head}: ops measured at x{self.measured:.2f} their prices, within "
                    f"{TOLERANCE:.0%}: plans unchanged")
        after = {None: "", True: "; the plans changed", False: "; the same plans came out"}
        return f"{head}: ops priced at x{self.factor:.2f} and planned again{after[self.changed]}"


def refines(config: TransformConfig, device: str) -> bool:
    """Whether a module with ``config`` on ``device`` refines its prices (module docstring)."""
    if config.budget is None or config.device_profile is not None or config.pipelined:
        return False
    from fxckpt.cost.cpu_table import several_processes, uses_measured_prices

    kind = torch.device(device).type
    if kind == "cuda":
        return not several_processes()
    return kind == "cpu" and uses_measured_prices()


class Refiner:
    """Counts a module's training calls, times the segments of a few, and re-plans once."""

    def __init__(self, config: TransformConfig, model: torch.nn.Module,
                 replan: Callable[[], None], plans: Callable[[], list[Plan]]) -> None:
        self.config = config
        self.model = model
        self.on: Optional[bool] = None
        """Whether this module refines (decided at its first training call: on the device the
        model is on by then)."""
        self.device = "cpu"
        self.replan = replan
        """Drops every plan, so that each is made again at its next call."""
        self.plans = plans
        """The plans the latest call ran."""
        self.calls = 0
        self.clocks: list[SegmentClock] = []
        """One per timed step."""
        self.factor = 1.0
        self.result: Optional[Refinement] = None
        self._before: Optional[list[tuple]] = None

    @contextlib.contextmanager
    def call(self, training: bool) -> Iterator[None]:
        """Around one call of the module: its plans priced at the factor found so far; timed,
        or made again, as the call's place among the training calls says."""
        timed: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.on is None and training:
            first = next(iter(self.model.parameters()), None)
            self.device = "cpu" if first is None else str(first.device)
            self.on = refines(self.config, self.device)
        if self.on and training and self.result is None:
            self.calls += 1
            if self.calls > WARMUP + TIMED:
                self._refine()
            elif self.calls > WARMUP:
                self.clocks.append(SegmentClock())
                timed = timing(self.clocks[-1])
        with refined(self.factor), timed:
            yield
        if self._before is not None and training:
            self._compare()

    def _refine(self) -> None:
        from fxckpt.cost.cpu_table import TABLE_RATE
        from fxckpt.cost.devices import profile_for
        from fxckpt.cost.prices import SEGMENT_COST

        steps = [clock.timed() for clock in self.clocks]
        measured = min(steps, key=lambda t: t.seconds / t.cost if t.cost > 0 else math.inf)
        profile = profile_for(None, torch.device(self.device))
        unit, overhead = TABLE_RATE, SEGMENT_COST / TABLE_RATE  # the table's (None)
        if profile is not None:
            unit, overhead = profile.unit, profile.segment
        factor = in_step_factor(measured.seconds, measured.cost, measured.runs, unit, overhead)
        replan = measured.runs > 0 and abs(math.log(factor)) > math.log1p(TOLERANCE)
        predicted = measured.cost / unit + forward_overhead(measured.runs, overhead)
        self.result = Refinement(TIMED, measured.runs, measured.seconds, predicted, factor,
                                 factor if replan else 1.0, replan)
        if replan:
            self.factor = factor
            self._before = [_structure(p) for p in self.plans()]
            self.replan()
        log.info("fxckpt: %s", self.result)

    def _compare(self) -> None:
        assert self.result is not None
        self.result.changed = [_structure(p) for p in self.plans()] != self._before
        self._before = None
        log.info("fxckpt: %s", self.result)


def _structure(plan: Plan) -> tuple:
    """What a plan decides: each segment's nodes, what it keeps, and how it saves."""
    return tuple((s.nodes, s.keeps, s.action) for s in plan.segments)

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

The timed steps are also timed whole, from the call to the end of its backward
(:class:`~fxckpt.runtime.clock.PassClock`). Less what the plans' recompute and segments add, as
priced, that is the step with no checkpoint; plus what another plan adds, that plan's step
(:meth:`Refinement.step_seconds`): how a user learns what a budget costs in time on their
machine, and how ``benchmarks.step_time`` checks a plan's predicted step against the measured one.

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
import statistics
from typing import Any, Callable, Iterator, Optional

import torch

from fxckpt.config import TransformConfig
from fxckpt.cost.refined import forward_overhead, in_step_factor, refined
from fxckpt.plan import Plan
from fxckpt.runtime.clock import PassClock, SegmentClock, timing

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
    forward_seconds: Optional[float] = None
    """The module's forward call, median of the timed steps."""
    backward_seconds: Optional[float] = None
    """The backward through its outputs (recompute included; a loss's own backward left out),
    median of the timed steps; ``None`` when no timed step ran one."""
    span_seconds: Optional[float] = None
    """From the call to the end of the backward through its outputs: the step as the training
    loop runs it, the loss included (the optimizer's step not), median of the timed steps;
    ``None`` when no timed step ran a backward."""
    recompute_share: float = 0.0
    """What the timed plans recompute, as a share of one forward (:attr:`Plan.recompute_share`)."""
    segments: int = 0
    """Checkpointed segments in the timed plans."""
    forward_price: Optional[float] = None
    """Seconds one forward's ops are priced at, the plans' prices (``None`` when the timed plans
    recompute nothing to say it by)."""
    overhead: float = 0.0
    """Seconds of one segment's fixed overhead, forward and backward, as priced."""

    def recompute_seconds(self, share: float, factor: float = 1.0) -> Optional[float]:
        """Seconds a plan recomputing ``share`` of a forward adds, its ops at ``factor`` times
        their prices (``None`` without :attr:`forward_price`)."""
        if self.forward_price is None:
            return None
        return share * self.forward_price * factor

    def base_seconds(self, factor: float = 1.0) -> Optional[float]:
        """The step (:attr:`span_seconds`) with no checkpoint, predicted from the timed steps:
        their measured span less what the timed plans' recompute (its ops at ``factor`` times
        their prices) and segments added."""
        again = self.recompute_seconds(self.recompute_share, factor)
        if self.span_seconds is None or again is None:
            return None
        return self.span_seconds - again - self.segments * self.overhead

    def step_seconds(self, share: float, segments: int, factor: float = 1.0) -> Optional[float]:
        """The step (:attr:`span_seconds`) predicted for a plan of ``segments`` segments that
        recomputes ``share`` of a forward (another budget's plan of the same model, or none):
        :meth:`base_seconds` plus what that plan adds.

        ``factor`` prices the recompute of both plans. At 1, their prices, the default: on the
        CPU bench models the factor the timed segments measure differs from plan to plan of one
        model (1.06 and 1.34 for BERT's plans at 0.5 and 0.75), so a plan's measured factor put
        on another plan's recompute missed by more than the prices did (docs/step_time.md)."""
        base, again = self.base_seconds(factor), self.recompute_seconds(share, factor)
        if base is None or again is None:
            return None
        return base + again + segments * self.overhead

    def _step_text(self) -> str:
        base, again = self.base_seconds(), self.recompute_seconds(self.recompute_share)
        if base is None or again is None:
            return ""
        assert self.span_seconds is not None
        ms = 1e3
        return (f"; a step took {self.span_seconds * ms:.1f} ms from the call to the end of "
                f"its backward (forward {(self.forward_seconds or 0) * ms:.1f} ms, backward "
                f"{(self.backward_seconds or 0) * ms:.1f} ms), of which the plans' "
                f"{again * ms:.1f} ms of recompute and {self.segments * self.overhead * ms:.1f} "
                f"ms of segment overhead (as priced): {base * ms:.1f} ms without them")

    def __str__(self) -> str:
        return self._text() + self._step_text()

    def _text(self) -> str:
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
        self.passes: list[PassClock] = []
        """One per timed step: its forward and backward."""
        self.factor = 1.0
        self.result: Optional[Refinement] = None
        self._before: Optional[list[tuple]] = None

    @contextlib.contextmanager
    def call(self, training: bool) -> Iterator[Callable[[Any], Any]]:
        """Around one call of the module: its plans priced at the factor found so far; timed,
        or made again, as the call's place among the training calls says. Yields what the call
        passes its outputs through (a timed call's backward is watched through them)."""
        timed: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        seen: Callable[[Any], Any] = _same
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
                self.passes.append(PassClock(torch.device(self.device)))
                self.passes[-1].start()
                seen = self.passes[-1].saw
        with refined(self.factor), timed:
            yield seen
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
                                 factor if replan else 1.0, replan,
                                 **_passes(self.passes, self.plans(), unit, overhead))
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


def _same(outputs: Any) -> Any:
    return outputs


def _passes(clocks: list[PassClock], plans: list[Plan], unit: float,
            overhead: float) -> dict[str, Any]:
    """The :class:`Refinement` fields of the timed steps' forward and backward, and of the plans
    they ran."""
    times = [clock.seconds() for clock in clocks]
    forward, backward, span = (_median([t[i] for t in times]) for i in range(3))
    recompute = sum(p.predicted_recompute or 0.0 for p in plans)
    ops = sum((p.predicted_recompute or 0.0) / p.recompute_share for p in plans
              if p.recompute_share)
    return {"forward_seconds": forward, "backward_seconds": backward, "span_seconds": span,
            "recompute_share": recompute / ops if ops > 0 else 0.0,
            "segments": sum(len(p.segments) for p in plans),
            "forward_price": ops / unit if ops > 0 else None, "overhead": overhead}


def _median(values: list[Optional[float]]) -> Optional[float]:
    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


def _structure(plan: Plan) -> tuple:
    """What a plan decides: each segment's nodes, what it keeps, and how it saves."""
    return tuple((s.nodes, s.keeps, s.action) for s in plan.segments)

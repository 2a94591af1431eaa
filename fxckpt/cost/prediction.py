"""The predicted memory and recompute cost of a plan, the same way for every strategy.

Every plan gets a predicted peak from the simulator (:mod:`fxckpt.solver.simulate`), so a plan
made by ``every=``, ``depth=``, ``force=`` or ``budget=`` reports comparable numbers.

The simulator counts tensors, not the short-lived temporaries of backward kernels (a gradient
being scaled, a weight gradient before it is added into ``.grad``) nor the scratch buffers
kernels allocate for themselves (a CPU convolution's reorders, :mod:`fxckpt.cost.scratch`). A
*reserve* the size of the largest single gradient or scratch buffer stands for them. It is part
of the problem the solver sees (:attr:`fxckpt.solver.Problem.reserve_bytes`, set by
:func:`fxckpt.cost.bridge.to_problem`): every simulated peak includes it and every budget the
solver meets counts it, so the figures here are the simulator's as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fxckpt.cost.runs import Run, keep_positions, to_spans
from fxckpt.solver import Problem, Spans, held_at_backward, simulate
from fxckpt.solver.floor import recompute_floor

__all__ = ["Prediction", "predict", "predict_spans", "recompute_share", "floor_share"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted facts of one plan, in bytes and the simulator's cost units."""

    peak: int
    """Peak activation memory of a training step with the plan, reserve included."""
    recompute: float
    """Cost of recomputing (or offloading) the plan's segments."""
    eager_peak: int
    """Peak activation memory of a training step without checkpointing, reserve included."""
    share: float
    """:func:`recompute_share` of the plan."""
    frees: tuple[int, ...]
    """Per run: bytes the step would hold from forward to backward that checkpointing the run
    lets go of (see :attr:`fxckpt.plan.SegmentSpec.freed_bytes`)."""


def recompute_share(problem: Problem, ranges: Spans, keep: Sequence[int] = ()) -> float:
    """The cost of the ops ``ranges`` run again (or offload), as a share of one forward pass.

    Both in the simulator's units (FLOPs plus memory traffic, see
    :mod:`fxckpt.cost.bridge`); the fixed per-segment overhead the solver also weighs is
    left out, so a share of 100% means "one more forward pass". ``Plan.recompute_share``, the
    summary and the Pareto chart all use this figure.
    """
    ix = problem.index
    forward = ix.cum_cost[-1]
    work = sum(ix.segment_cost(a, b) - ix.overhead for a, b in ranges)
    work -= ix.kept_gain(ranges, keep)
    return work / forward if forward else 0.0


def floor_share(problem: Problem, peak: int) -> float:
    """The least :func:`recompute_share` any plan whose simulated peak is at most ``peak``
    could have (:func:`fxckpt.solver.floor.recompute_floor`, its one segment overhead left out
    as the share leaves it out): what a plan's share is compared with."""
    ix = problem.index
    floor = recompute_floor(problem, peak)
    forward = ix.cum_cost[-1]
    if floor <= 0 or not forward:
        return 0.0
    return max(0.0, floor - ix.overhead) / forward


def predict(problem: Problem, runs: Sequence[Run], keeps: Sequence[str] = ()) -> Prediction:
    """Simulate ``runs`` (and no checkpointing) on ``problem``; ``keeps`` names kept nodes."""
    return predict_spans(problem, to_spans(problem, runs), keep_positions(problem, keeps))


def predict_spans(problem: Problem, ranges: Spans, keep: Sequence[int] = ()) -> Prediction:
    """:func:`predict` for segments given as the solver's op ranges (and kept op positions)."""
    eager_held, held = held_at_backward(problem), held_at_backward(problem, ranges, keep)
    sim = simulate(problem, ranges, keep)
    return Prediction(
        peak=sim.peak_bytes,
        recompute=sim.recompute_cost,  # offload-aware, less what is kept
        eager_peak=simulate(problem, ()).peak_bytes,
        share=recompute_share(problem, ranges, keep),
        frees=tuple(sum(max(e - h, 0) for e, h in zip(eager_held[a:b], held[a:b]))
                    for a, b in ranges),
    )

"""Per segment under ``offload="auto"``: recompute it, or keep it with its saved tensors offloaded.

This is for copies that cost the step their time (the CPU's); on a GPU they run beside the
compute and :mod:`fxckpt.planning.overlap` decides instead.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fxckpt.cost.runs import Run, to_spans
from fxckpt.plan import SegmentSpec
from fxckpt.solver import Problem

__all__ = ["decide_actions"]


def decide_actions(problem: Problem, segments: Sequence[SegmentSpec],
                   runs: Sequence[Run]) -> tuple[tuple[SegmentSpec, ...], str]:
    """Each segment's action: offload when the problem's offload price beats recomputing it.

    The solver already priced every segment at the cheaper of the two (``Problem``'s
    ``offload_cost_per_byte``), so the segments it chose are the cheapest plan under the budget
    with three states per op: kept, recomputed, or kept with its saved tensors offloaded.
    Returns the segments and a note for the plan.
    """
    ranges = to_spans(problem, runs)
    offloads = [problem.index.segment_offloads(a, b) for a, b in ranges]
    hidden = _within_the_forward(problem, ranges, offloads)
    chosen = tuple(
        dataclasses.replace(seg, action="offload" if off else "recompute")
        for seg, off in zip(segments, offloads)
    )
    moved = sum(s.action == "offload" for s in chosen)
    note = (f"offload='auto': {moved} of {len(chosen)} segment(s) offload, the rest recompute "
            f"(moving a byte costs {problem.offload_cost_per_byte:.3g} FLOP-equivalents)")
    if hidden:
        note += (f"; {hidden} more would have offloaded, but their copies to the host would "
                 "take longer than the forward they must hide behind: they recompute")
    return chosen, note


def _within_the_forward(problem: Problem, ranges: Sequence[tuple[int, int]],
                        offloads: list[bool]) -> int:
    """Turn offloads into recomputes, most bytes first, until copying what the rest offload to
    the host takes no longer than the forward (which the copies run behind); how many turned.

    Offloading costs ``per byte`` out and back; out alone is half of it, in the same units as
    the ops' costs (time at one rate), so the copies fit behind the forward when half the
    offloaded bytes' price is at most the forward's cost.
    """
    per_byte = problem.offload_cost_per_byte or 0.0
    index = problem.index
    forward = sum(op.cost for op in problem.ops)
    out = {i: per_byte / 2 * (index.cum_saved[b] - index.cum_saved[a])
           for i, (a, b) in enumerate(ranges) if offloads[i]}
    turned = 0
    for i in sorted(out, key=out.__getitem__, reverse=True):
        if sum(out[j] for j in out if offloads[j]) <= forward:
            break
        offloads[i] = False
        turned += 1
    return turned

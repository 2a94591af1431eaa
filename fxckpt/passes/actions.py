"""Per segment under ``offload="auto"``: recompute it, or keep it with its saved tensors offloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fxckpt.passes.runs import Run, to_ranges
from fxckpt.plan import Segment
from fxckpt.solver import Problem

__all__ = ["choose_actions"]


def choose_actions(problem: Problem, segments: Sequence[Segment],
                   runs: Sequence[Run]) -> tuple[tuple[Segment, ...], str]:
    """Each segment's action: offload when the problem's offload price beats recomputing it.

    The solver already priced every segment at the cheaper of the two (``Problem``'s
    ``offload_cost_per_byte``), so the segments it chose are the cheapest plan under the budget
    with three states per op: kept, recomputed, or kept with its saved tensors offloaded.
    Returns the segments and a note for the plan.
    """
    ranges = to_ranges(problem, runs)
    chosen = tuple(
        dataclasses.replace(
            seg, action="offload" if problem.index.segment_offloads(a, b) else "recompute"
        )
        for seg, (a, b) in zip(segments, ranges)
    )
    moved = sum(s.action == "offload" for s in chosen)
    note = (f"offload='auto': {moved} of {len(chosen)} segment(s) offload, the rest recompute "
            f"(moving a byte costs {problem.offload_cost_per_byte:.3g} FLOP-equivalents)")
    return chosen, note

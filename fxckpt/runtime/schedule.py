"""The GPipe fill-drain schedule: which (micro-batch, stage) pairs run at each clock tick.

Micro-batch ``i`` runs on stage ``j`` at clock ``i + j``. Every pair of a clock is independent
(different micro-batches on different stages), so devices work in parallel within a clock:

    clock      0   1   2   3   4   5
    stage 0    0   1   2   3   .   .        4 micro-batches x 3 stages:
    stage 1    .   0   1   2   3   .        6 clocks, of which each stage idles 2
    stage 2    .   .   0   1   2   3        bubble = (K-1)/(M+K-1) = 2/6

The idle share ("bubble") shrinks as the number of micro-batches ``M`` grows relative to the
number of stages ``K``. Backward runs the same pattern in reverse, driven by autograd.
"""

from __future__ import annotations

from typing import Iterator

from fxckpt.checks import check_int

__all__ = ["clock_cycles", "bubble_fraction", "schedule_chart", "checkpoint_stop"]


def _check(chunks: int, stages: int) -> None:
    check_int("chunks", chunks)
    check_int("stages", stages)


def clock_cycles(chunks: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """For each clock, the ``(micro-batch, stage)`` pairs that run in it."""
    _check(chunks, stages)
    for k in range(chunks + stages - 1):
        yield [(k - j, j) for j in range(max(0, k - chunks + 1), min(k + 1, stages))]


def checkpoint_stop(chunks: int, checkpoint: str) -> int:
    """torchgpipe's rule: micro-batches ``i < checkpoint_stop`` recompute their stage in backward
    (``always``: all of them, ``except_last``: all but the last, ``never``: none)."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]


def bubble_fraction(chunks: int, stages: int) -> float:
    """The share of stage-clocks spent idle in fill and drain: ``(K-1) / (M+K-1)``."""
    _check(chunks, stages)
    return (stages - 1) / (chunks + stages - 1)


def schedule_chart(chunks: int, stages: int, recompute_stop: int | None = None) -> str:
    """An ASCII chart of the forward schedule; ``*`` marks micro-batches that recompute.

    ``recompute_stop`` is the first micro-batch that is not checkpointed (torchgpipe's
    ``checkpoint_stop``); ``None`` leaves the chart unmarked.
    """
    _check(chunks, stages)
    clocks = chunks + stages - 1
    grid = [["." for _ in range(clocks)] for _ in range(stages)]
    for k, pairs in enumerate(clock_cycles(chunks, stages)):
        for i, j in pairs:
            grid[j][k] = f"{i}*" if recompute_stop is not None and i < recompute_stop else str(i)
    width = max(len(str(clocks - 1)), max(len(c) for row in grid for c in row)) + 2
    label = max(len(f"stage {stages - 1}"), len("clock"))
    lines = [
        f"GPipe fill-drain: {chunks} micro-batch(es) x {stages} stage(s), {clocks} clocks, "
        f"bubble (K-1)/(M+K-1) = {stages - 1}/{clocks} = {bubble_fraction(chunks, stages):.0%}",
        "clock".ljust(label) + "".join(str(k).rjust(width) for k in range(clocks)),
    ]
    lines += [
        f"stage {j}".ljust(label) + "".join(c.rjust(width) for c in row)
        for j, row in enumerate(grid)
    ]
    if recompute_stop:
        lines.append("* = checkpointed: recomputed in backward")
    return "\n".join(lines)

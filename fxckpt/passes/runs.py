"""Node runs and the solver's op ranges: one segment, two ways of naming it.

Strategies choose segments as *runs*: contiguous lists of fx nodes in graph order. The solver
and simulator (:mod:`fxckpt.solver`) see *ranges*: half-open ``(start, end)`` intervals over the
ops of a :class:`~fxckpt.solver.Problem`, where a node that keeps bytes no node outputs is
preceded by a synthetic ``<node>::saved`` op (see :mod:`fxckpt.passes.graph_view`). This module
converts between the two, in one place.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx

from fxckpt.passes.annotate import info
from fxckpt.passes.graph_view import SYNTHETIC
from fxckpt.solver import Problem, Segments

__all__ = ["Run", "to_ranges", "ranges_of", "to_runs", "keep_positions", "kept_names",
           "recomputed"]

Run = list[torch.fx.Node]
"""A contiguous run of compute nodes, in graph order: one segment."""


def to_ranges(problem: Problem, runs: Sequence[Run]) -> Segments:
    """Op ranges of node runs (a run starts at its first node's synthetic op when it has one)."""
    return ranges_of(problem, [[n.name for n in run] for run in runs])


def ranges_of(problem: Problem, runs: Sequence[Sequence[str]]) -> Segments:
    """Op ranges of runs given by node names (a plan's ``Segment.nodes``)."""
    position = {op.name: i for i, op in enumerate(problem.ops)}
    ranges = []
    for names in runs:
        start = position[names[0]]
        if start > 0 and problem.ops[start - 1].name == names[0] + SYNTHETIC:
            start -= 1
        ranges.append((start, position[names[-1]] + 1))
    return tuple(ranges)


def to_runs(problem: Problem, ranges: Segments, order: Sequence[torch.fx.Node]) -> list[Run]:
    """Node runs of op ranges (synthetic ops dropped; empty runs left out)."""
    by_name = {n.name: n for n in order}
    runs = []
    for start, end in ranges:
        run = [by_name[op.name] for op in problem.ops[start:end] if op.name in by_name]
        if run:
            runs.append(run)
    return runs


def keep_positions(problem: Problem, names: Sequence[str]) -> tuple[int, ...]:
    """Op positions of kept nodes (each with its synthetic op, when it has one)."""
    position = {op.name: i for i, op in enumerate(problem.ops)}
    return tuple(sorted(position[m] for name in names for m in (name + SYNTHETIC, name)
                        if m in position))


def kept_names(problem: Problem, positions: Sequence[int]) -> tuple[str, ...]:
    """Node names of kept op positions (synthetic ops dropped)."""
    return tuple(problem.ops[j].name for j in sorted(positions)
                 if not problem.ops[j].name.endswith(SYNTHETIC))


def recomputed(run: Run) -> Run:
    """The nodes of ``run`` its recompute runs again: torch's non-reentrant checkpoint stops once
    the last saved tensor is back, so nodes after the last node that saves anything are not run,
    and that node only if it saves its own output or hidden tensors (autograd saves an op's
    inputs before its kernel runs). The solver prices segments the same way
    (:attr:`fxckpt.solver.Problem.early_stop`)."""
    for k in range(len(run) - 1, -1, -1):
        i = info(run[k])
        if i.saves or i.saves_internal_bytes:
            own = run[k].name in i.saves or i.saves_internal_bytes > 0
            return run[:k + 1] if own else run[:k]
    return []

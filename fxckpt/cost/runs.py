"""Node runs and the solver's op ranges: one segment, two ways of naming it.

Strategies choose segments as *runs*: contiguous lists of fx nodes in graph order. The solver
and simulator (:mod:`fxckpt.solver`) see *ranges*: half-open ``(start, end)`` intervals over the
ops of a :class:`~fxckpt.solver.Problem`, where a node that keeps bytes no node outputs is
preceded by a synthetic ``<node>::saved`` op (see :mod:`fxckpt.cost.bridge`). This module
converts between the two, in one place.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx

from fxckpt.cost.bridge import SYNTHETIC
from fxckpt.solver import Problem, Spans

__all__ = ["Run", "to_spans", "spans_of", "to_runs", "keep_positions", "kept_names",
           "recomputed"]

Run = list[torch.fx.Node]
"""A contiguous run of compute nodes, in graph order: one segment."""


def to_spans(problem: Problem, runs: Sequence[Run]) -> Spans:
    """Op ranges of node runs (a run starts at its first node's synthetic op when it has one)."""
    return spans_of(problem, [[n.name for n in run] for run in runs])


def spans_of(problem: Problem, runs: Sequence[Sequence[str]]) -> Spans:
    """Op ranges of runs given by node names (a plan's ``SegmentSpec.nodes``)."""
    position = {op.name: i for i, op in enumerate(problem.ops)}
    ranges = []
    for names in runs:
        start = position[names[0]]
        if start > 0 and problem.ops[start - 1].name == names[0] + SYNTHETIC:
            start -= 1
        ranges.append((start, position[names[-1]] + 1))
    return tuple(ranges)


def to_runs(problem: Problem, ranges: Spans, order: Sequence[torch.fx.Node]) -> list[Run]:
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


def recomputed(problem: Problem, runs: Sequence[Run]) -> list[Run]:
    """The nodes of each run that its recompute runs again, up to the run's early stop as the
    solver prices it (:attr:`fxckpt.solver.Problem.early_stop`: nodes after the last one that
    saves anything are not run, nor that one's kernel when it saves only its inputs)."""
    ix = problem.index
    again = []
    for run, (start, end) in zip(runs, to_spans(problem, runs)):
        names = {problem.ops[j].name for j in range(start, ix.recompute_end(start, end))}
        again.append([n for n in run if n.name in names])
    return again

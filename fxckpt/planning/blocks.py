"""Blocks: the op ranges of a graph that come from the items of a module list.

A stack of layers is ``nn.ModuleList`` (or ``nn.Sequential``) items: ``transformer.h.3``,
``layer2.1``. Every node whose module path runs through such an item (the first numbered part
of the path) belongs to that item's block. A block is a candidate for solving once
(:mod:`fxckpt.solver.shared`) when its nodes run as one stretch of the graph; which blocks are
really alike is the solver's check, on the problem's numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.fx

from fxckpt.cost.annotate import info
from fxckpt.cost.bridge import SYNTHETIC
from fxckpt.solver.problem import Problem

__all__ = ["block_of", "block_ranges"]


def block_of(path: str) -> Optional[str]:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``; None outside numbered items."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def block_ranges(problem: Problem, order: Sequence[torch.fx.Node]) -> list[tuple[int, int]]:
    """``(start, end)`` op ranges of ``problem`` (the graph's planned nodes ``order``), one per
    block whose nodes are contiguous. Nodes without a module path (graph glue) do not break a
    block; a block interrupted by another module's nodes is left out."""
    position = {op.name: i for i, op in enumerate(problem.ops)}
    runs: list[tuple[str, torch.fx.Node, torch.fx.Node]] = []
    for n in order:
        path = info(n).module_path
        if not path or n.name not in position:
            continue
        block = block_of(path)
        if block is not None and runs and runs[-1][0] == block:
            runs[-1] = (block, runs[-1][1], n)
        else:
            runs.append((block or "", n, n))
    named = [r for r in runs if r[0]]
    counts: dict[str, int] = {}
    for block, _, _ in named:
        counts[block] = counts.get(block, 0) + 1
    return [(position.get(first.name + SYNTHETIC, position[first.name]), position[last.name] + 1)
            for block, first, last in named if counts[block] == 1]

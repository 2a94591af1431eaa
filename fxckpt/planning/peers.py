"""The plans people write by hand, on this graph: the starts the budget search must beat.

Each is a :class:`~fxckpt.solver.starts.Start` over the solver's Problem, built from the graph's
blocks (the items of its layer list, :mod:`fxckpt.planning.blocks`) and the aten op each node is
runs (its aten calls, and what it calls):

* ``per-block``: every block one segment, as ``torch.utils.checkpoint`` around each layer;
* ``sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` with about the square root of
  the blocks as segments: runs of whole blocks, the last run not checkpointed;
* ``op policy``: per block, keeping every matmul's and attention kernel's output (torchtitan's
  op-level selective checkpointing: the pointwise ops are recomputed);
* ``op policy (every other mm)``: the same keeping every second ``mm`` only, as torchtitan's
  ``_op_sac_save_list`` policy does to save memory;
* ``Megatron selective``: per block, keeping the linear layers' outputs and recomputing the
  attention core (Megatron-LM's ``--recompute-granularity selective``, among the ops the solver
  may keep).

Only groups the solver is offered (or pinned) may be kept: a start never keeps a random op or
one written in place, any more than the search does. ``torch.compile``'s min-cut is not a start:
it is measured against, not imitated (``benchmarks/methods.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch.fx

from fxckpt.cost.annotate import info
from fxckpt.planning.keeps import Groups
from fxckpt.solver import Problem
from fxckpt.solver.starts import Start

__all__ = ["peer_starts", "kind_of", "MATMULS"]

MATMULS = frozenset({"mm", "addmm", "matmul", "linear"})
"""The aten ops a linear layer runs as."""


def kind_of(node: torch.fx.Node) -> str:
    """``attention`` for an attention kernel (fused, or run as its math: batched matmuls around
    a softmax, as on the meta device), ``matmul`` for a linear layer's, else ``""``."""
    ops = {c.split(".")[1] for c in info(node).calls}
    target = str(getattr(node.target, "__name__", node.target))
    if "attention" in target or any("attention" in op for op in ops) or ops & {"bmm", "baddbmm"}:
        return "attention"
    return "matmul" if ops & MATMULS else ""


def peer_starts(problem: Problem, order: Sequence[torch.fx.Node],
                blocks: Sequence[tuple[int, int]], groups: Groups) -> list[Start]:
    """The hand-written plans of the module docstring for ``problem`` (the graph's planned nodes
    ``order``), keeping only among ``groups``; none without at least two blocks."""
    spans = tuple(sorted(blocks))
    if len(spans) < 2 or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return []
    nodes = {n.name: n for n in order}
    kinds = [kind_of(nodes[op.name]) if op.name in nodes else "" for op in problem.ops]
    inside = [g for g in groups if any(s <= g[-1] < e for s, e in spans)]

    def keeping(wanted: Callable[[str], bool]) -> tuple[tuple[int, ...], ...]:
        return tuple(g for g in inside if wanted(kinds[g[-1]]))

    mms = [g for g in inside if kinds[g[-1]] == "matmul"]
    every_other = {g for k, g in enumerate(mms) if k % 2 == 0}
    starts = [
        Start(name="per-block", segments=spans),
        Start(name="op policy", segments=spans, keep=keeping(bool)),
        Start(name="op policy (every other mm)", segments=spans,
              keep=tuple(g for g in inside if g in every_other or kinds[g[-1]] == "attention")),
        Start(name="Megatron selective", segments=spans,
              keep=keeping(lambda k: k == "matmul")),
    ]
    runs = max(2, round(math.sqrt(len(spans))))
    size = math.ceil(len(spans) / runs)
    chunks = [spans[i:i + size] for i in range(0, len(spans), size)]
    if len(chunks) > 1:
        starts.append(Start(name="sequential",
                            segments=tuple((c[0][0], c[-1][1]) for c in chunks[:-1])))
    return starts

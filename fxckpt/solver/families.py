"""Families: the repeated blocks of a problem that are alike, op for op, and one block as a
problem of its own (what :mod:`fxckpt.solver.shared` solves once per family).

Two blocks are alike when every op has the same bytes, cost, gradient bytes and saved tensors,
the model returns the same ones, and each reads and saves the same ops of its own block (by
offset) or outside values of the same bytes (:func:`structure`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from fxckpt.solver.problem import Key, Problem, Span

__all__ = ["MIN_COPIES", "structure", "families", "block_problem"]

MIN_COPIES = 4
"""A family needs at least this many identical blocks."""


def structure(problem: Problem, block: Span) -> Hashable:
    """What makes two blocks the same for planning: per op, its bytes, cost, gradient bytes,
    saved tensors, whether the model returns it, and what it reads and saves: ops of the block
    by their offset in it, anything outside by its bytes."""
    s, e = block
    ops, ix = problem.ops, problem.index
    pos = ix.memo.get(Key[dict[str, int]]("position"),
                      lambda: {op.name: i for i, op in enumerate(ops)})

    def ref(name: str) -> tuple[str, int]:
        j = pos.get(name)
        if j is not None and s <= j < e:
            return ("in", j - s)
        return ("out", -1 if j is None else ix.out[j])

    return tuple(
        (op.out_bytes, op.cost, op.gradient_bytes, op.saved_tensors, ix.is_output[s + k],
         tuple(map(ref, op.inputs)), tuple(map(ref, op.saves)))
        for k, op in enumerate(ops[s:e]))


def families(problem: Problem, blocks: Sequence[Span]) -> list[list[Span]]:
    """The candidate ``blocks`` (disjoint op ranges) grouped by :func:`structure`, groups of at
    least :data:`MIN_COPIES` only, in the order of their first block."""
    def make() -> list[list[Span]]:
        groups: dict[Hashable, list[Span]] = {}
        for block in sorted(blocks):
            s, e = block
            if 0 <= s < e <= problem.index.n:
                groups.setdefault(structure(problem, block), []).append(block)
        return [g for g in groups.values() if len(g) >= MIN_COPIES]

    return problem.index.memo.get(Key[list[list[Span]]]("families", tuple(blocks)), make)


def block_problem(problem: Problem, block: Span) -> Problem:
    """The ops of ``block`` as a problem of their own: what they read from outside are graph
    inputs; what later ops read, save or the model returns are its outputs."""
    s, e = block
    ix = problem.index
    ops = problem.ops[s:e]
    outputs = tuple(ops[k].name for k in range(e - s)
                    if ix.is_output[s + k] or ix.last_alive[s + k] >= e
                    or any(t >= e for t in ix.savers[s + k]))
    if not outputs:
        outputs = (ops[-1].name,)
    return Problem(ops=ops, outputs=outputs, segment_overhead=problem.segment_overhead,
                   keep_overhead=problem.keep_overhead, early_stop=problem.early_stop,
                   saved_overhead=problem.saved_overhead,
                   offload_cost_per_byte=problem.offload_cost_per_byte)

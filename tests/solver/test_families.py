"""Families of alike blocks, and one block as a problem of its own (fxckpt.solver.families)."""

from __future__ import annotations

from .test_shared import stack

from fxckpt.solver.families import MIN_COPIES, block_problem, families, structure


def test_blocks_alike_op_for_op_form_a_family_and_a_different_one_stays_out() -> None:
    problem, blocks = stack(6, odd=2)
    assert structure(problem, blocks[0]) == structure(problem, blocks[1])
    assert structure(problem, blocks[0]) != structure(problem, blocks[2])  # a wider activation
    (family,) = families(problem, blocks)
    assert family == [b for i, b in enumerate(blocks) if i != 2] and len(family) >= MIN_COPIES
    assert families(problem, blocks) is families(problem, blocks)  # made once per problem


def test_a_block_alone_reads_its_inputs_as_graph_inputs_and_returns_what_later_ops_read() -> None:
    problem, blocks = stack(5)
    alone = block_problem(problem, blocks[1])
    assert [op.name for op in alone.ops] == ["norm1", "up1", "act1", "down1", "res1"]
    assert alone.graph_inputs == ("res0",)
    assert alone.outputs == ("res1",)  # the next block reads it; nothing else leaves the block
    assert alone.segment_overhead == problem.segment_overhead

"""solver/problem.py: the price of a segment's saved-tensor hooks."""

from __future__ import annotations

import pytest

from fxckpt.solver import Op, Problem, simulate


def _chain(saved_overhead: float, offload: float | None = None) -> Problem:
    """x -> a (saves x and a weight) -> b (saves a) -> c (saves nothing): output c."""
    return Problem(ops=(
        Op(name="a", out_bytes=100, cost=50.0, inputs=("x",), saves=("x",), saved_tensors=2),
        Op(name="b", out_bytes=100, cost=10.0, inputs=("a",), saves=("a",), saved_tensors=1),
        Op(name="c", out_bytes=100, cost=1.0, inputs=("b",)),
    ), outputs=("c",), segment_overhead=5.0, saved_overhead=saved_overhead,
        offload_cost_per_byte=offload)


def test_a_segment_pays_for_every_tensor_its_ops_save() -> None:
    plain, hooked = _chain(0.0).index, _chain(3.0).index
    assert plain.segment_cost(0, 3) == 50 + 10 + 1 + 5
    assert hooked.segment_cost(0, 3) == plain.segment_cost(0, 3) + 3 * 3.0  # 2 + 1 tensors
    assert hooked.segment_cost(1, 3) == plain.segment_cost(1, 3) + 1 * 3.0
    assert hooked.hooks(2, 3) == 0.0  # c saves nothing
    assert simulate(_chain(3.0), [(0, 3)]).recompute_cost == hooked.segment_cost(0, 3)


def test_keeping_an_op_does_not_spare_its_hooks() -> None:
    # a kept op is not run again, but autograd still saves its inputs through the hooks
    kept = simulate(_chain(3.0), [(0, 3)], keep=[0]).recompute_cost
    assert kept == _chain(3.0).index.segment_cost(0, 3) - 50.0


def test_offloading_is_chosen_on_the_ops_prices_alone() -> None:
    # offloading moves the same saved tensors through hooks: the hooks do not tip the choice
    for overhead in (0.0, 1e6):
        ix = _chain(overhead, offload=0.05).index
        # moving a's 100 saved bytes (x is an input, not the segment's) costs 5 < 60 to rerun
        assert ix.segment_offloads(0, 3)
        assert ix.segment_cost(0, 3) == 100 * 0.05 + 5 + 3 * overhead


@pytest.mark.parametrize("bad", [-1.0, float("inf"), True])
def test_a_bad_saved_overhead_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="Problem.saved_overhead must be a finite number >= 0"):
        _chain(bad)  # type: ignore[arg-type]


def test_a_negative_saved_tensor_count_is_refused() -> None:
    with pytest.raises(ValueError, match="saved_tensors"):
        Op(name="a", out_bytes=1, cost=1.0, saved_tensors=-1)


def test_the_solver_caches_are_typed_entries_made_once() -> None:
    from fxckpt.solver.problem import Key, Memo

    memo, made = Memo(), []

    def make() -> list[int]:
        made.append(1)
        return [1, 2]

    key = Key[list[int]]("numbers", ("a", 1))
    assert memo.find(key) is None
    assert memo.get(key, make) == [1, 2] and memo.get(key, make) is memo.get(key, make)
    assert made == [1]  # made the first time only
    assert memo.find(Key[list[int]]("numbers", ("a", 1))) == [1, 2]  # equal keys, one entry
    assert memo.find(Key[list[int]]("numbers", ("a", 2))) is None
    memo.put(Key[str]("name"), "x")
    assert memo.get(Key[str]("name"), lambda: "y") == "x"


def test_no_solver_cache_is_read_through_an_untyped_key() -> None:
    """Every cache on an index goes through a typed key: no ``# type: ignore`` on a read."""
    import pathlib

    import fxckpt.solver

    root = pathlib.Path(fxckpt.solver.__file__).parent
    found = [f"{p.name}:{i}" for p in sorted(root.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "memo" in line and "type: ignore" in line]
    assert not found

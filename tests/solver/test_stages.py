"""The stage-partition DP against exhaustive search, and its argument checks."""

from __future__ import annotations

import itertools
import random
from typing import Optional, Sequence

import pytest

from fxckpt.solver.stages import (
    check_balance,
    partition,
    partition_from_balance,
    stage_costs,
)


def exhaustive(
    costs: Sequence[float], stages: int, allowed: Optional[Sequence[int]] = None
) -> float:
    """The smallest slowest-stage cost over every choice of cut points."""
    positions = range(1, len(costs)) if allowed is None else sorted(allowed)
    return min(
        max(stage_costs(costs, cuts)) for cuts in itertools.combinations(positions, stages - 1)
    )


def test_matches_exhaustive_search_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 10)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 7, 100, round(rng.random() * 9, 3)]) for _ in range(n)]
        allowed = None
        if rng.random() < 0.5:
            allowed = [p for p in range(1, n) if rng.random() < 0.7]
            if len(allowed) < k - 1:
                continue
        got = partition(costs, k, allowed)
        assert got.bottleneck == pytest.approx(exhaustive(costs, k, allowed), rel=1e-12)
        assert len(got.cuts) == k - 1 and list(got.cuts) == sorted(set(got.cuts))
        assert sum(got.sizes) == n and min(got.sizes) >= 1
        assert allowed is None or set(got.cuts) <= set(allowed)


def test_beats_the_greedy_fill() -> None:
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    got = partition(costs, 3)
    assert got.bottleneck == 14 == exhaustive(costs, 3)
    assert got.costs == stage_costs(costs, got.cuts)


def test_one_stage_and_one_node_per_stage() -> None:
    assert partition([1, 2, 3], 1).cuts == ()
    assert partition([1, 2, 3], 3).cuts == (1, 2)
    assert partition([0, 0, 0, 0], 2).bottleneck == 0


def test_large_inputs_are_fast() -> None:
    rng = random.Random(1)
    costs = [rng.random() for _ in range(3000)]
    got = partition(costs, 8)
    assert got.bottleneck <= sum(costs) / 8 + max(costs)


@pytest.mark.parametrize(
    "costs, stages, allowed, message",
    [
        ([1, 2], 3, None, r"cannot cut 2 node\(s\) into 3 non-empty stages"),
        ([1, 2], 0, None, r"number of stages must be a positive integer \(got 0\)"),
        ([1, 2], 1.5, None, r"got 1.5"),
        ([1, -2], 1, None, r"non-negative numbers \(got -2 at position 1\)"),
        ([1, float("nan")], 1, None, r"got nan"),
        ([1, 2, 3, 4], 3, [2], r"3 stages need 2 cut points but only 1 positions may be cut"),
    ],
)
def test_bad_arguments(costs: list, stages: object, allowed: Optional[list], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(costs, stages, allowed)  # type: ignore[arg-type]


def test_balance_rules() -> None:
    assert check_balance([2, 1], 3) == (2, 1)
    assert partition_from_balance([1, 2, 3], [1, 2]).costs == (1.0, 5.0)
    with pytest.raises(
        ValueError,
        match=r"must sum to the graph's 3 compute node\(s\) \(got \[1, 1\], which sums to 2\)",
    ):
        check_balance([1, 1], 3)
    with pytest.raises(ValueError, match=r"integers >= 1.*got 0 for stage 1"):
        check_balance([3, 0], 3)
    with pytest.raises(ValueError, match=r"non-empty list of node counts"):
        check_balance([], 3)
    with pytest.raises(ValueError, match=r"non-empty list of node counts"):
        check_balance("12", 3)
    with pytest.raises(
        ValueError, match=r"cuts at node position\(s\) \[1\], where a stage may not start"
    ):
        partition_from_balance([1, 2, 3], [1, 2], allowed=[2])

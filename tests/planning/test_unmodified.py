"""planning/unmodified.py: which calls run the model unmodified, and how few are measured.

The unmodified step's peak is scripted here: ``FIXED + PER_ROW * rows`` bytes for a batch of
``rows`` rows of width 4 (weights and gradients fixed, activations proportional), which is what
the line through measured peaks assumes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from fxckpt.planning.plan_cache import PlanCache
from fxckpt.planning.unmodified import Unmodified

FIXED, PER_ROW = 1000, 100


class Steps:
    """Calls of a growing batch through one :class:`Unmodified`, with the measurements made."""

    def __init__(self, budget: int, fails_at: Optional[int] = None) -> None:
        self.state = Unmodified(budget)
        self.measured: list[int] = []
        self.fails_at = fails_at

    def peak_at(self, args: tuple, kwargs: dict) -> Optional[int]:
        rows = args[0].shape[0]
        if self.fails_at is not None and rows >= self.fails_at and rows != self.own:
            return None  # a loss_fn closing over the call's own sizes, say
        self.measured.append(rows)
        return FIXED + PER_ROW * rows

    def __call__(self, rows: int) -> bool:
        self.own = rows
        x = torch.zeros(rows, 4)
        return self.state.runs(((rows, 4),), (x,), {}, self.peak_at,
                               lambda a, k: (tuple(a[0].shape),))


def test_a_growing_batch_runs_unmodified_until_it_would_not_fit_measured_a_few_times() -> None:
    steps = Steps(budget=FIXED + PER_ROW * 100)  # the unmodified step fits up to 100 rows
    ran = [steps(rows) for rows in range(1, 121)]
    assert ran == [rows <= 64 for rows in range(1, 121)]  # 65..100 would fit, unmeasured
    # at 1; then, one peak bounding the line from above (the line through it and zero), as far
    # ahead as the bound holds under 0.9 of the budget (2 -> 8); then, two peaks giving the
    # line, as far as it holds so (9 -> 64); then at the bucket, 128, over: closed for good
    assert steps.measured == [1, 8, 64, 128]
    assert steps.state.closed and not steps(1)  # even a small call is planned from then on
    assert sorted(s[0][0] for s in steps.state.held) == [1, 8, 64]


def test_a_call_covered_by_sizes_that_held_is_not_measured_again() -> None:
    steps = Steps(budget=10 ** 9)
    assert steps(8) and steps(3) and steps(8)
    assert steps.measured == [8] and steps.state.peak == FIXED + PER_ROW * 8


def test_the_first_call_over_the_budget_closes_the_way() -> None:
    steps = Steps(budget=FIXED + PER_ROW * 10)
    assert not steps(16) and steps.measured == [16]
    assert steps.state.closed and not steps(2) and steps.measured == [16]


def test_sizes_the_step_cannot_run_at_give_way_to_the_calls_own() -> None:
    steps = Steps(budget=10 ** 9, fails_at=5)
    assert steps(4) and steps(6) and steps(7)
    assert steps.measured == [4, 6, 7] and not steps.state.buckets


def test_the_plan_cache_starts_where_the_unmodified_step_stopped_fitting() -> None:
    """The first plan is made at the bucket beyond the largest sizes that held, fitted against
    the unmodified peak measured there (the build is given it: not measured again)."""
    steps = Steps(budget=FIXED + PER_ROW * 100)
    for rows in range(1, 66):
        steps(rows)
    cache: PlanCache = PlanCache()
    cache.start_from(steps.state.held, steps.state.measured)
    built: list[tuple[Any, Any]] = []

    def build(args: tuple, kwargs: dict, budget: object, eager: object) -> Any:
        built.append((tuple(args[0].shape), eager))
        plan = SimpleNamespace(budget=FIXED + PER_ROW * 100, verified_peak=FIXED,
                               segments=("seg",))
        return SimpleNamespace(plan=plan)

    x = torch.zeros(65, 4)
    cache.make(((65, 4),), (x,), {}, build, lambda a, k: (tuple(a[0].shape),),
               lambda s: True, planned_larger=False)
    assert built == [((128, 4), FIXED + PER_ROW * 128)]

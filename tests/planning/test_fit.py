"""The fit pass's loop on hand-made plans and verifiers: tighten, fall back, refuse, report."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxckpt.budget import BudgetInfeasibleError
from fxckpt.planning.fit import ATTEMPTS, fit
from fxckpt.planning.strategies import Fitting
from fxckpt.plan import Plan
from fxckpt.verify import VerifyError
from handmade import Tiny, plan, segment, traced

BUDGET = 1000
FIRST = segment("seg_0", ("fc1", "relu"), inputs=("x",), outputs=("relu",))


def _base() -> torch.fx.GraphModule:
    return traced(Tiny(), torch.randn(3, 4))


class Scripted:
    """A ``choose`` that records the fittings it was asked with and a ``verify`` that answers
    from a script: the n-th verified plan (the eager graph first) gets ``peaks[n]``."""

    def __init__(self, peaks: list[int], *, minimum: int = 0) -> None:
        self.peaks, self.minimum = list(peaks), minimum
        self.fittings: list[Fitting] = []

    def choose(self, fitting: Fitting) -> Plan:
        self.fittings.append(fitting)
        predicted = BUDGET - 100 - fitting.tighten
        if fitting.minimum:
            predicted = 10
        return dataclasses.replace(plan(FIRST), predicted_peak=predicted, eager_peak=2000,
                                   budget=BUDGET)

    def verify(self, gm: torch.fx.GraphModule) -> int:
        if self.fittings and self.fittings[-1].minimum:
            return self.minimum
        return self.peaks.pop(0)


def test_a_plan_that_fits_at_once_is_kept() -> None:
    s = Scripted([2000, 950])
    got, _ = fit(_base(), s.choose, s.verify)
    assert (got.verified_peak, got.verified_eager_peak, got.notes) == (950, 2000, ())
    assert s.fittings == [Fitting(eager_bytes=2000)]


def test_a_plan_without_segments_is_the_eager_graph_and_is_not_verified_again() -> None:
    verified: list[torch.fx.GraphModule] = []

    def verify(gm: torch.fx.GraphModule) -> int:
        verified.append(gm)
        return 700

    def choose(fitting: Fitting) -> Plan:
        return dataclasses.replace(plan(), predicted_peak=690, eager_peak=700, budget=BUDGET)

    got, gm = fit(_base(), choose, verify)
    assert (got.verified_peak, got.verified_eager_peak) == (700, 700)
    assert len(verified) == 1 and gm is not verified[0]


def test_an_overshoot_is_solved_again_lower_until_it_fits() -> None:
    s = Scripted([2000, 1100, 1020, 990])
    got, _ = fit(_base(), s.choose, s.verify)
    assert got.verified_peak == 990
    tightens = [f.tighten for f in s.fittings]
    assert tightens[0] == 0 and tightens == sorted(tightens) and len(set(tightens)) == 3
    assert tightens[1] >= 1100 - BUDGET  # at least the overshoot
    assert "solved again 2 time(s)" in got.notes[-1]


def test_when_no_attempt_fits_the_smallest_plan_is_tried() -> None:
    s = Scripted([2000] + [1100] * ATTEMPTS, minimum=800)
    got, _ = fit(_base(), s.choose, s.verify)
    assert s.fittings[-1].minimum and got.verified_peak == 800
    assert "smallest peak" in got.notes[-1]


def test_when_the_smallest_plan_is_over_too_the_budget_is_refused_with_its_figure() -> None:
    s = Scripted([2000] + [1100] * ATTEMPTS, minimum=1234)
    with pytest.raises(BudgetInfeasibleError) as e:
        fit(_base(), s.choose, s.verify)
    assert (e.value.budget, e.value.min_budget) == (BUDGET, 1234)
    assert "Give budget >= 1234" in str(e.value) and "verified" in str(e.value)


def test_plans_that_are_not_solved_are_verified_not_tightened() -> None:
    s = Scripted([2000, 1500])
    got, _ = fit(_base(), s.choose, s.verify, solved=False)
    assert got.verified_peak == 1500 and len(s.fittings) == 1


def test_a_step_that_cannot_run_on_fake_tensors_keeps_the_simulated_figures() -> None:
    def fails(gm: torch.fx.GraphModule) -> int:
        raise VerifyError("the training step could not run on fake tensors: boom")

    s = Scripted([])
    got, gm = fit(_base(), s.choose, fails)
    assert got.verified_peak is None and got.peak_bytes == got.predicted_peak
    assert got.notes[-1].startswith("the peak is simulated, not verified")
    assert "boom" in got.notes[-1]
    assert isinstance(gm, torch.fx.GraphModule)

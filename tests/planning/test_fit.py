"""The fit pass's loop on hand-made plans and verifiers: tighten, fall back, refuse, report."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxckpt.budget import BudgetInfeasibleError, parse_budget
from fxckpt.planning.fit import ATTEMPTS, Target, fit, infeasible
from fxckpt.plan import Plan
from fxckpt.measure.verify import VerifyError
from handmade import Tiny, plan, segment, traced

BUDGET = 1000
FIRST = segment("seg_0", ("fc1", "relu"), inputs=("x",), outputs=("relu",))


def _base() -> torch.fx.GraphModule:
    return traced(Tiny(), torch.randn(3, 4))


class Scripted:
    """A ``plan_at`` that records the targets it was asked with and a ``verify`` that answers
    from a script: the n-th verified plan (the eager graph first) gets ``peaks[n]``."""

    def __init__(self, peaks: list[int], *, minimum: int = 0) -> None:
        self.peaks, self.minimum = list(peaks), minimum
        self.targets: list[Target] = []

    def plan_at(self, target: Target) -> Plan:
        self.targets.append(target)
        predicted = BUDGET - 100 - target.lowered
        if target.minimum:
            predicted = 10
        return dataclasses.replace(plan(FIRST), predicted_peak=predicted, eager_peak=2000,
                                   budget_bytes=BUDGET)

    def verify(self, gm: torch.fx.GraphModule) -> int:
        if self.targets and self.targets[-1].minimum:
            return self.minimum
        return self.peaks.pop(0)


def test_a_plan_that_fits_at_once_is_kept() -> None:
    s = Scripted([2000, 950])
    got, _ = fit(_base(), s.plan_at, s.verify)
    assert (got.verified_peak, got.verified_eager_peak, got.notes) == (950, 2000, ())
    assert s.targets == [Target(eager_bytes=2000)]


def test_a_plan_without_segments_is_the_eager_graph_and_is_not_verified_again() -> None:
    verified: list[torch.fx.GraphModule] = []

    def verify(gm: torch.fx.GraphModule) -> int:
        verified.append(gm)
        return 700

    def plan_at(target: Target) -> Plan:
        return dataclasses.replace(plan(), predicted_peak=690, eager_peak=700, budget_bytes=BUDGET)

    got, gm = fit(_base(), plan_at, verify)
    assert (got.verified_peak, got.verified_eager_peak) == (700, 700)
    assert len(verified) == 1 and gm is not verified[0]


def test_an_overshoot_is_solved_again_lower_until_it_fits() -> None:
    s = Scripted([2000, 1100, 1020, 990])
    got, _ = fit(_base(), s.plan_at, s.verify)
    assert got.verified_peak == 990
    lowered = [f.lowered for f in s.targets]
    assert lowered[0] == 0 and lowered == sorted(lowered) and len(set(lowered)) == 3
    assert lowered[1] >= 1100 - BUDGET  # at least the overshoot
    assert "solved again 2 time(s)" in got.notes[-1]


def test_when_no_attempt_fits_the_smallest_plan_is_tried() -> None:
    s = Scripted([2000] + [1100] * ATTEMPTS, minimum=800)
    got, _ = fit(_base(), s.plan_at, s.verify)
    assert s.targets[-1].minimum and got.verified_peak == 800
    assert "smallest peak" in got.notes[-1]


def test_when_the_smallest_plan_is_over_too_the_budget_is_refused_with_its_figure() -> None:
    s = Scripted([2000] + [1100] * ATTEMPTS, minimum=1234)
    with pytest.raises(BudgetInfeasibleError) as e:
        fit(_base(), s.plan_at, s.verify)
    assert (e.value.budget, e.value.min_budget) == (BUDGET, 1234)
    assert "Give budget >= 1234" in str(e.value) and "verified" in str(e.value)


def test_plans_that_are_not_solved_are_verified_not_tightened() -> None:
    s = Scripted([2000, 1500])
    got, _ = fit(_base(), s.plan_at, s.verify, solved=False)
    assert got.verified_peak == 1500 and len(s.targets) == 1


def test_a_step_that_cannot_run_on_fake_tensors_keeps_the_simulated_figures() -> None:
    def fails(gm: torch.fx.GraphModule) -> int:
        raise VerifyError("the training step could not run on fake tensors: boom")

    s = Scripted([])
    got, gm = fit(_base(), s.plan_at, fails)
    assert got.verified_peak is None and got.peak_bytes == got.predicted_peak
    assert got.notes[-1].startswith("the peak is simulated, not verified")
    assert "boom" in got.notes[-1]
    assert isinstance(gm, torch.fx.GraphModule)


def test_a_target_resolves_the_budget_and_moves_it_only_by_what_verification_found() -> None:
    half, mib = parse_budget(0.5), parse_budget(1 << 20)
    assert Target().limit(half, 800) == 400  # a fraction of the simulated eager peak
    verified = Target(eager_bytes=1000)
    assert verified.limit(half, 800) == 500  # ... of the verified one when known
    assert verified.limit(mib, 800) == 1 << 20
    assert verified.set_aside(800) == 200 and Target().set_aside(800) == 0
    assert verified.aim(500, 800) == 300  # what the verified step holds beyond it, set aside
    moved = dataclasses.replace(verified, lowered=50, raised=20)
    assert moved.aim(500, 800) == 270
    assert moved.allowed(500) == 500  # lowered more than raised: the budget itself
    assert dataclasses.replace(verified, raised=70).allowed(500) == 570


def test_a_plan_well_under_its_prediction_is_solved_again_with_the_aim_raised() -> None:
    class Loose(Scripted):
        def plan_at(self, target: Target) -> Plan:
            self.targets.append(target)
            share = 0.5 - target.raised / 1000
            return dataclasses.replace(plan(FIRST), predicted_peak=900 + target.raised,
                                       eager_peak=2000, budget_bytes=BUDGET, recompute_share=share)

    s = Loose([2000, 700, 980])  # 200 under its prediction, then a plan that still fits
    got, _ = fit(_base(), s.plan_at, s.verify, loosen=True)
    assert [t.raised for t in s.targets] == [0, 200]
    assert got.verified_peak == 980 and got.recompute_share == pytest.approx(0.3)
    assert "raised" in got.notes[-1]
    s = Loose([2000, 700, 1080])  # the looser plan does not fit: the first one stays
    got, _ = fit(_base(), s.plan_at, s.verify, loosen=True)
    assert got.verified_peak == 700 and got.notes == ()


def test_a_plan_that_fits_far_under_after_an_overshoot_is_bisected_towards_the_budget() -> None:
    """The second target may drop far below the budget (it lowers by the overshoot or the
    plan's own gap); targets in between are tried, and the cheapest plan that fits is taken."""
    class Shares(Scripted):
        def plan_at(self, target: Target) -> Plan:
            chosen = super().plan_at(target)
            return dataclasses.replace(chosen, recompute_share=0.2 + target.lowered / 1000)

    s = Shares([2000, 1100, 800, 950, 1050, 1010])
    got, _ = fit(_base(), s.plan_at, s.verify)
    # over at 0, fits at 200 (200 unused), then 100 fits (cheaper), 50 and 75 are over
    assert [t.lowered for t in s.targets] == [0, 200, 100, 50, 75]
    assert got.verified_peak == 950 and got.recompute_share == pytest.approx(0.3)
    assert "lowered by 100 B" in got.notes[-1]
    s = Shares([2000, 1100, 990])  # fits within 2% of the budget: nothing to bisect
    got, _ = fit(_base(), s.plan_at, s.verify)
    assert [t.lowered for t in s.targets] == [0, 200] and got.verified_peak == 990


def test_the_message_names_the_budget_the_smallest_peak_and_the_fixes() -> None:
    err = infeasible(1000, 1500, 4000, asked="0.25 of the eager peak", verified=True)
    assert isinstance(err, BudgetInfeasibleError)
    assert (err.budget, err.min_budget) == (1000, 1500)
    assert str(err) == (
        "budget 0.25 of the eager peak = 1000 B (1000 bytes) cannot be met: the smallest peak "
        "activation memory any plan reaches for this model and input is 1.5 KiB (1500 bytes, "
        "verified by running the plan on fake tensors; 0.375 of the unmodified step's 3.9 KiB). "
        "Give budget >= 1500 (bytes; a fraction >= 0.375), or, for a budget in bytes, a smaller "
        "batch (a fraction of a smaller step is harder to meet: weight gradients and the loss do "
        "not shrink with it)")


def test_without_an_eager_peak_no_fraction_is_offered() -> None:
    text = str(infeasible(1000, 1500, 0))
    assert text.startswith("budget 1000 B (1000 bytes) cannot be met")
    assert "fraction >=" not in text and "unmodified step" not in text


def test_a_step_that_holds_far_less_than_simulated_is_widened_by_bisection() -> None:
    """``widen`` (a plan fitted to the compiled step): the unmodified step is tried first, then
    the target is bisected between the last raise that fit and the first that did not, and the
    plan that recomputes least and fits is kept. A fraction resolves against ``fraction_of``."""
    class Compiled(Scripted):
        def plan_at(self, target: Target) -> Plan:
            self.targets.append(target)
            segments = () if target.raised > 1000 else (FIRST,)
            return dataclasses.replace(plan(*segments), predicted_peak=900 + target.raised,
                                       eager_peak=2000, budget_bytes=BUDGET,
                                       recompute_share=0.5 - target.raised / 10000)

    # the unmodified compiled step (1500), the first plan (600), then raises of 500 (fits),
    # 750 (over), 625 (fits) and 687 (over); 1001, the unmodified step, is not verified again
    s = Compiled([1500, 600, 900, 1050, 980, 1010])
    got, _ = fit(_base(), s.plan_at, s.verify, widen=True, fraction_of=2000)
    assert [t.raised for t in s.targets] == [0, 1001, 500, 750, 625, 687]
    assert s.targets[0].eager_bytes == 2000 and not s.peaks
    assert got.verified_peak == 980 and got.recompute_share == pytest.approx(0.4375)
    assert got.verified_eager_peak == 1500 and "widened" in got.notes[-1]
    # the unmodified step fits: it is the plan, no bisection
    s = Compiled([900, 600])
    got, _ = fit(_base(), s.plan_at, s.verify, widen=True)
    assert [t.raised for t in s.targets] == [0, 1001] and got.segments == ()
    assert got.verified_peak == 900

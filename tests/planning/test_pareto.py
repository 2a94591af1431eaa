"""planning/pareto.py: one solver plan per budget, from the smallest feasible peak to eager's."""

from __future__ import annotations

import pytest
import torch

from fxckpt.errors import ConfigTypeError
from fxckpt.planning.pareto import pareto
from handmade import Tiny


@pytest.fixture(scope="module")
def curve() -> list[dict[str, float]]:
    return pareto(Tiny(), example_inputs=(torch.randn(3, 4),), points=4)


def test_points_are_sorted_by_budget_and_each_fits_its_budget(curve) -> None:
    assert 1 <= len(curve) <= 4
    assert all(set(p) == {"budget", "predicted_peak", "recompute", "eager_peak"} for p in curve)
    budgets = [p["budget"] for p in curve]
    assert budgets == sorted(budgets)
    assert all(p["predicted_peak"] <= p["budget"] for p in curve)


def test_a_smaller_budget_never_predicts_a_higher_peak_or_less_recompute(curve) -> None:
    peaks = [p["predicted_peak"] for p in curve]
    assert peaks == sorted(peaks)
    shares = [p["recompute"] for p in curve]
    assert shares == sorted(shares, reverse=True) and all(s >= 0 for s in shares)


def test_every_point_carries_the_same_eager_peak_and_none_exceeds_it(curve) -> None:
    (eager,) = {p["eager_peak"] for p in curve}
    assert all(p["predicted_peak"] <= eager for p in curve)


def test_a_non_module_is_a_config_type_error() -> None:
    with pytest.raises(ConfigTypeError,
                       match=r"^model must be a torch.nn.Module \(got int\); wrap a function"):
        pareto(3)

"""budget= holds the measured peak, keeps gradients exact, and fails clearly when it cannot."""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from fxckpt.measure import step_peak_tracked
from models import MLP, ResNet, gpt2
from support import assert_steps_equal, loss_of, run_step

CASES = [
    ("mlp", lambda: MLP(depth=16, width=128, p=0.1), lambda: (torch.randn(32, 128, requires_grad=True),)),
    ("resnet", lambda: ResNet(ch=16), lambda: (torch.randn(4, 3, 16, 16, requires_grad=True),)),
    ("gpt2", lambda: gpt2(layers=3), lambda: (torch.randint(0, 64, (4, 16)),)),
]


def _measured_peak(tm: torch.nn.Module, args: tuple) -> int:
    return step_peak_tracked(lambda: loss_of(tm(*args)).backward(), warmup=1, repeats=1)["peak_bytes"]


@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fraction", [0.6, 0.8])
def test_measured_peak_stays_under_the_budget(name: str, make, inputs, fraction: float) -> None:
    model = make()
    reference = copy.deepcopy(model)
    args = inputs()
    tm = fxckpt.transform(model, budget=fraction, example_inputs=args)
    plan = fxckpt.inspect(tm).plan
    assert plan.budget == int(fraction * plan.eager_peak)
    assert plan.predicted_peak <= plan.budget and plan.segments
    assert_steps_equal(run_step(tm, args, {}, seed=5), run_step(reference, args, {}, seed=5))
    measured = _measured_peak(tm, args)
    assert measured <= plan.budget * 1.05, f"{name}: measured {measured} > budget {plan.budget}"
    assert measured <= plan.predicted_peak * 1.05 and measured >= plan.predicted_peak * 0.85


def test_smaller_budget_never_gives_higher_peak() -> None:
    model, x = MLP(depth=12, width=64), torch.randn(16, 64)
    peaks = []
    for fraction in (1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3):
        plan = fxckpt.inspect(fxckpt.transform(copy.deepcopy(model), budget=fraction, example_inputs=(x,))).plan
        peaks.append(plan.predicted_peak)
    assert peaks == sorted(peaks, reverse=True)
    curve = fxckpt.pareto(model, example_inputs=(x,))
    assert [p["predicted_peak"] for p in curve] == sorted(p["predicted_peak"] for p in curve)
    assert all(p["predicted_peak"] <= p["budget"] for p in curve)
    assert curve[-1]["recompute"] == 0.0 and curve[0]["recompute"] > 0


def test_absolute_budget_in_bytes_and_units() -> None:
    model, x = MLP(depth=12, width=64), torch.randn(16, 64)
    eager = fxckpt.inspect(fxckpt.transform(copy.deepcopy(model), budget=1.0, example_inputs=(x,))).plan.eager_peak
    tm = fxckpt.transform(model, budget=f"{eager * 0.6 / 1024:.1f}KiB", example_inputs=(x,))
    assert fxckpt.inspect(tm).plan.predicted_peak <= eager * 0.6 and fxckpt.inspect(tm).plan.strategy == "budget"


def test_infeasible_budget_states_the_minimum() -> None:
    x = torch.randn(16, 64)
    with pytest.raises(fxckpt.BudgetInfeasibleError) as e:
        fxckpt.transform(MLP(depth=12, width=64), budget=0.01, example_inputs=(x,))
    err = e.value
    assert isinstance(err, ValueError) and err.min_budget > err.budget
    assert f"Give budget >= {err.min_budget}" in str(err) and "cannot be met" in str(err)
    ok = fxckpt.transform(MLP(depth=12, width=64), budget=err.min_budget, example_inputs=(x,))
    assert fxckpt.inspect(ok).plan.predicted_peak <= err.min_budget


def test_one_infeasible_budget_exception() -> None:
    """fxckpt's public error is the solver's exception with fxckpt's error base."""
    from fxckpt.solver import BudgetInfeasible

    err = fxckpt.BudgetInfeasibleError(100, 250, "budget 100 bytes cannot be met")
    assert isinstance(err, BudgetInfeasible) and isinstance(err, fxckpt.FxckptError)
    assert isinstance(err, ValueError)
    assert (err.budget, err.min_budget, str(err)) == (100, 250, "budget 100 bytes cannot be met")
    plain = BudgetInfeasible(100, 250)
    assert str(plain) == ("no checkpoint plan keeps the predicted peak activation memory under "
                          "100 bytes; the smallest budget any plan meets is 250 bytes")
    with pytest.raises(BudgetInfeasible, match="smallest peak"):
        fxckpt.transform(MLP(depth=4, width=32), budget=0.01, example_inputs=(torch.randn(4, 32),))


@pytest.mark.parametrize("other", [{"every": 2}, {"depth": 2}])
def test_budget_with_another_strategy_is_rejected(other: dict) -> None:
    with pytest.raises(fxckpt.ConfigError, match=r"give at most one strategy, got .*budget=0.5 of the eager peak"):
        fxckpt.transform(MLP(), budget=0.5, **other)

"""budget= holds the measured peak, keeps gradients exact, and fails clearly when it cannot.

A budget fraction is checked against the *measured* eager peak: the unmodified model's step
measured with the same protocol (the live-tensor tracker with kernels' scratch, one warm-up step)
as the transformed model's, never against the plan's own figures. The plan's verified peak (the
step run on fake tensors) must agree with that measurement within 5%; the simulated one may miss.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import fxckpt
from fxckpt.measure import step_peak_tracked
from fxckpt.cost.scratch import call_scratch
from models import MLP, ResNet, gpt2
from support import assert_steps_equal, loss_of, run_step

CASES = [
    (
        "mlp",
        lambda: MLP(depth=16, width=128, p=0.1),
        lambda: (torch.randn(32, 128, requires_grad=True),),
    ),
    ("resnet", lambda: ResNet(ch=16), lambda: (torch.randn(4, 3, 16, 16, requires_grad=True),)),
    ("gpt2", lambda: gpt2(layers=3), lambda: (torch.randint(0, 64, (4, 16)),)),
]


def _measured_peak(module: torch.nn.Module, args: tuple) -> int:
    """Peak live tensor bytes of one training step after a warm-up step (gradients exist)."""
    def step() -> None:
        loss_of(module(*args)).backward()

    peak = step_peak_tracked(step, warmup=1, repeats=1, scratch=call_scratch)
    return peak["peak_bytes"]


def _loss(out: object, *inputs: object) -> torch.Tensor:
    return loss_of(out)


@functools.cache
def _measured_eager_peak(name: str) -> int:
    """The unmodified model's measured peak (shapes, not weights, decide it: one per case)."""
    _, make, inputs = next(c for c in CASES if c[0] == name)
    return _measured_peak(make(), inputs())


@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fraction", [0.6, 0.8])
def test_measured_peak_stays_under_the_budget(name: str, make, inputs, fraction: float) -> None:
    model = make()
    reference = copy.deepcopy(model)
    args = inputs()
    tm = fxckpt.transform(model, budget=fraction, example_inputs=args, loss_fn=_loss)
    plan = fxckpt.inspect(tm).plan
    assert plan.verified_eager_peak is not None and plan.verified_peak is not None
    assert plan.budget_bytes == int(fraction * plan.verified_eager_peak)
    assert plan.verified_peak <= plan.budget_bytes and plan.segments
    assert_steps_equal(run_step(tm, args, {}, seed=5), run_step(reference, args, {}, seed=5))
    eager, measured = _measured_eager_peak(name), _measured_peak(tm, args)
    limit = fraction * eager * 1.05
    assert measured <= limit, f"{name}: {measured} > 1.05 x {fraction} x measured eager {eager}"
    assert abs(measured / plan.verified_peak - 1) <= 0.05, (measured, plan.verified_peak)
    assert abs(plan.verified_eager_peak / eager - 1) <= 0.05, (plan.verified_eager_peak, eager)


def test_smaller_budget_never_gives_higher_peak() -> None:
    model, x = MLP(depth=12, width=64), torch.randn(16, 64)
    peaks = []
    for fraction in (1.0, 0.9, 0.75, 0.6, 0.5, 0.4):
        plan = fxckpt.inspect(
            fxckpt.transform(copy.deepcopy(model), budget=fraction, example_inputs=(x,))
        ).plan
        peaks.append(plan.peak_bytes)
    assert peaks == sorted(peaks, reverse=True)
    curve = fxckpt.pareto(model, example_inputs=(x,))
    assert [p["predicted_peak"] for p in curve] == sorted(p["predicted_peak"] for p in curve)
    assert all(p["predicted_peak"] <= p["budget"] for p in curve)
    assert curve[-1]["recompute"] == 0.0 and curve[0]["recompute"] > 0


def test_absolute_budget_in_bytes_and_units() -> None:
    model, x = MLP(depth=12, width=64), torch.randn(16, 64)
    eager = _measured_peak(copy.deepcopy(model), (x,))
    budget = f"{int(eager * 0.6) // 1024}KiB"
    tm = fxckpt.transform(model, budget=budget, example_inputs=(x,), loss_fn=_loss)
    plan = fxckpt.inspect(tm).plan
    assert plan.strategy == "budget" and plan.peak_bytes == plan.verified_peak
    assert plan.verified_peak <= plan.budget_bytes <= eager * 0.6
    measured = _measured_peak(tm, (x,))
    limit = plan.budget_bytes
    assert measured <= limit * 1.05, f"{measured} > 1.05 x {budget} = {limit} bytes"


def test_infeasible_budget_states_the_minimum() -> None:
    x = torch.randn(16, 64)
    with pytest.raises(fxckpt.BudgetInfeasibleError) as e:
        fxckpt.transform(MLP(depth=12, width=64), budget=0.01, example_inputs=(x,))
    err = e.value
    assert isinstance(err, ValueError) and err.min_budget > err.budget
    assert f"Give budget >= {err.min_budget}" in str(err) and "cannot be met" in str(err)
    assert "verified by running the plan on fake tensors" in str(err)
    ok = fxckpt.transform(MLP(depth=12, width=64), budget=err.min_budget, example_inputs=(x,))
    assert fxckpt.inspect(ok).plan.verified_peak <= err.min_budget


_MINIMUM_CASES = [pytest.param(*CASES[0], id="mlp"),
                  pytest.param(*CASES[1], id="resnet"),
                  pytest.param(*CASES[2], id="gpt2", marks=pytest.mark.slow)]  # 15-45 s


@pytest.mark.parametrize("name,make,inputs", _MINIMUM_CASES)
def test_the_stated_minimum_is_held_when_measured(name: str, make, inputs) -> None:
    args = inputs()
    with pytest.raises(fxckpt.BudgetInfeasibleError) as e:
        fxckpt.transform(make(), budget=0.05, example_inputs=args, loss_fn=_loss)
    minimum = e.value.min_budget
    tm = fxckpt.transform(make(), budget=minimum, example_inputs=args, loss_fn=_loss)
    measured = _measured_peak(tm, args)
    assert measured <= minimum * 1.05, f"{name}: {measured} > 1.05 x the stated minimum {minimum}"


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
    with pytest.raises(
        fxckpt.ConfigError, match=r"give at most one strategy, got .*budget=0.5 of the eager peak"
    ):
        fxckpt.transform(MLP(), budget=0.5, **other)

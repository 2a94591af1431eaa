"""Varying shapes (dynamic padding) cost no capture: one graph serves every length, exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from models import MLP, gpt2
from support import assert_steps_equal, run_step

LENGTHS = (12, 7, 20, 7, 5, 16)


@pytest.mark.slow
def test_gpt2_trains_at_every_length_with_one_capture_and_one_plan() -> None:
    model = gpt2(layers=2)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=3, capture="graph")
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(0, 64, (2, length))
        assert_steps_equal(
            run_step(tm, (ids,), {}, seed=step), run_step(reference, (ids,), {}, seed=step)
        )
    info = fxckpt.inspect(tm)
    assert info.plan.capture == "export" and info.captures == 1 and info.plans_made == 1


@pytest.mark.slow
def test_a_budget_plans_per_shape_and_reuses_plans_made_for_larger_ones() -> None:
    model = gpt2(layers=2)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=0.6, capture="graph")
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(0, 64, (2, length))
        assert_steps_equal(
            run_step(tm, (ids,), {}, seed=step), run_step(reference, (ids,), {}, seed=step)
        )
    info = fxckpt.inspect(tm)
    # 12 is the first plan; 20 grows past it, so the plan is made for the bucket 32; 7 and 5
    # reuse the plan for 12, 16 the plan for 32.
    assert info.captures == 1 and info.plans_made == 2
    assert sorted(p.signature for p in info.plans) == ["(int64[2, 12])", "(int64[2, 32])"]


def test_symbolic_graphs_serve_every_batch_size() -> None:
    model = MLP()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2, capture="graph")
    for step, batch in enumerate((8, 3, 17, 1)):
        x = torch.randn(batch, 32)
        assert_steps_equal(
            run_step(tm, (x,), {}, seed=step), run_step(reference, (x,), {}, seed=step)
        )
    assert fxckpt.inspect(tm).captures == 1 and fxckpt.inspect(tm).plans_made == 1


def _bytes(model: torch.nn.Module, batch: int, fraction: float) -> int:
    """``fraction`` of the unmodified step's verified peak at ``batch``, in bytes."""
    tm = fxckpt.transform(copy.deepcopy(model), budget=0.99,
                          example_inputs=(torch.randn(batch, 32),), capture="graph")
    peak = fxckpt.inspect(tm).plan.eager_peak_bytes
    assert peak is not None
    return int(fraction * peak)


def test_a_growing_batch_is_planned_at_power_of_two_buckets() -> None:
    model = MLP(width=32)
    reference = copy.deepcopy(model)
    budget = _bytes(model, 64, 0.6)
    tm = fxckpt.transform(model, budget=budget, capture="graph")
    for step, batch in enumerate(range(1, 41)):
        x = torch.randn(batch, 32)
        tm.zero_grad()
        reference.zero_grad()
        if step % 13 == 0:  # a few checked for bits; all run
            assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                               run_step(reference, (x,), {}, seed=step))
        else:
            tm(x).sum().backward()
    info = fxckpt.inspect(tm)
    # One capture (symbolic_trace is shape-free). The first plan is the unmodified step (its
    # peak, verified on the graph, fits at batch 1), checked at power-of-two buckets as the
    # batch grows; where it would not fit, a plan with segments is made at the bucket beyond.
    from fxckpt.module import dispatcher_of
    (entry,) = [e for es in dispatcher_of(tm).entries.values() for e in es]
    sizes = sorted(s[0][0] for s in entry.plans.plans)
    assert all(n & (n - 1) == 0 for n in sizes) and max(sizes) == 64, sizes
    assert info.captures == 1 and info.plans_made <= 3
    assert len(info.plans) == info.plans_made
    assert not info.plans[0].segments and info.plan.segments
    assert "fits the budget: nothing is recomputed" in " ".join(info.plans[0].notes)
    for p in info.plans:
        assert p.verified_peak is not None and p.verified_peak <= budget
    from fxckpt.serve.whole_graph import peak_at
    largest = entry.plans.plans[((64, 32),)]
    peak = peak_at(largest, dispatcher_of(tm).config, (torch.randn(64, 32),), {}, tm)
    assert peak is not None and peak <= budget  # the plan serving 33..40 holds at 64 too


def test_buckets_give_way_when_the_loss_fn_holds_the_batch_size() -> None:
    """A ``loss_fn`` closing over targets of the call's size cannot run at bucketed sizes: the
    call's own sizes are planned, and buckets are not tried again."""
    targets = {"y": torch.randn(4, 4)}
    # planned at once (example_inputs): calls of this structure are planned, not run unmodified
    tm = fxckpt.transform(MLP(), budget="1GiB",
                          loss_fn=lambda out, x: (out - targets["y"]).square().mean(),
                          example_inputs=(torch.randn(4, 32),), capture="graph")
    for batch in (4, 6, 7):
        targets["y"] = torch.randn(batch, 4)
        (tm(torch.randn(batch, 32)) - targets["y"]).square().mean().backward()
    info = fxckpt.inspect(tm)
    assert sorted(p.signature for p in info.plans) == [
        "(float32[4, 32])", "(float32[6, 32])", "(float32[7, 32])"]


def test_a_budget_the_unmodified_step_fits_plans_no_segment_measured_on_the_graph() -> None:
    """A call whose unmodified step, verified on the captured graph (never by running the
    model's forward on fake tensors), fits the budget gets a plan with no segment: the same
    gradients; a larger call it would not fit gets segments."""
    targets: dict[str, torch.Tensor] = {}
    model = MLP()
    reference = copy.deepcopy(model)
    budget = _bytes(model, 64, 0.8)
    tm = fxckpt.transform(model, budget=budget,
                          loss_fn=lambda out, x: (out - targets["y"]).square().mean(),
                          capture="graph")
    for step, batch in enumerate((4, 6, 7, 3, 96, 5)):
        targets["y"] = torch.randn(batch, 4)
        x = torch.randn(batch, 32)
        tm.zero_grad()
        reference.zero_grad()
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
        plan = fxckpt.inspect(tm).plan
        assert plan.verified_peak is not None and plan.verified_peak <= budget
        assert bool(plan.segments) == (batch == 96), (batch, plan.summary())
    assert fxckpt.inspect(tm).captures == 1


def test_a_smaller_batch_never_fails_a_budget_a_larger_one_met(
        caplog: pytest.LogCaptureFixture) -> None:
    """A fraction of a small step is mostly what does not shrink with the batch (weight
    gradients): the small call's own plan cannot meet it, so it gets the smallest-peak plan, and
    a warning says so."""
    model = MLP(depth=6, width=256)
    reference = copy.deepcopy(model)
    # under export a batch of one is a capture of its own (export specialises sizes 0 and 1)
    tm = fxckpt.transform(model, budget=0.5, capture="export")
    tm(torch.randn(512, 256)).sum().backward()
    with pytest.raises(fxckpt.BudgetInfeasibleError, match="a fraction >= "):
        fxckpt.transform(copy.deepcopy(reference), budget=0.5, capture="export",
                         example_inputs=(torch.randn(1, 256),))
    x = torch.randn(1, 256)
    tm.zero_grad()
    with caplog.at_level("WARNING", logger="fxckpt.serve.plan_cache"):
        got = run_step(tm, (x,), {}, seed=0)
    assert "a larger call was planned under it" in caplog.text
    assert_steps_equal(got, run_step(reference, (x,), {}, seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["graph", "auto"])
def test_the_growing_batch_bench_plans_far_fewer_times_than_it_steps(capture: str) -> None:
    from benchmarks.report import machine_info
    from benchmarks.shapes import growing, render

    result = growing(steps=12, layers=1, seq=16, fraction=0.85, capture=capture)
    assert result["capture"] == capture
    # not one per size (12 per graph): buckets, and plans reused where they hold; through
    # Dynamo the model's loss runs as a second graph (a break at Hugging Face's logging)
    assert result["plans"] <= 6 * result["graphs"], result
    assert 0.0 < result["share"] < 1.0
    rows = [{"strategy": "s", "captures": 1, "plans": 1, "planning_s": 1.0, "one_plan_s": 1.0,
             "step_s": 0.1}]
    text = render({"layers": 1, "steps": 1, "batch": 1, "lengths": 1, "range": (1, 1),
                   "rows": rows, "growing": [result]}, machine_info())
    assert f"| {capture} | {result['graphs']} | {result['captures']} | {result['plans']} |" \
        in text

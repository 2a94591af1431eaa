"""Prices refined from the first training steps' segment times, and the plans made again once.

Most tests fix the measured factor (``in_step_factor`` patched) so that what is planned again
does not depend on this machine's timings; one runs the measured path as a user does.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn

import fxckpt
import fxckpt.serve.refine as refine
from fxckpt.config import TransformConfig
from fxckpt.cost.cpu_table import ENV, TABLE_RATE
from fxckpt.cost.devices import cpu_profile
from fxckpt.cost.refined import FORWARD_SHARE, LIMITS
from fxckpt.serve.refine import TIMED, TOLERANCE, WARMUP, Refinement, refines
from models import gpt2
from patterns import PATTERNS, Pattern
from support import Slow, assert_steps_equal, run_step

STEPS = WARMUP + TIMED + 3
REFINED_AT = WARMUP + TIMED  # the index of the call that plans again


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def mlp() -> nn.Module:
    return nn.Sequential(*[Block(32) for _ in range(6)])


def cnn() -> nn.Module:
    def unit(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[unit(8) for _ in range(5)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


MODELS = {"mlp": (mlp, (4, 16, 32), 0.5), "cnn": (cnn, (4, 3, 16, 16), 0.75)}
"""Each model, its input's shape and a budget a few segments meet."""


@pytest.fixture
def factor(monkeypatch: pytest.MonkeyPatch) -> "Factor":
    """Refinement on under the test suite's table prices, with the factor the test sets."""
    monkeypatch.setattr(refine, "refines", lambda config, device: config.budget is not None)
    chosen = Factor()
    monkeypatch.setattr(refine, "in_step_factor", lambda *a: chosen.value)
    return chosen


class Factor:
    value = 1.0


def _train(name: str, capture: str,
           budget: Optional[float] = None) -> tuple[list[int], list, list]:
    """Eager and transformed side by side for STEPS steps, an SGD step after each: the same
    bits every step. After each call: the plans made so far, the refinement, and the plans the
    call ran."""
    make, shape, fits = MODELS[name]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=budget or fits, capture=capture)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-4) for m in (model, reference)]
    x = torch.randn(*shape)
    made, results, ran = [], [], []
    for step in range(STEPS):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (k, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{k} differs after step {step}"
        made.append(fxckpt.inspect(tm)._dispatcher.counts.plans)
        results.append(fxckpt.inspect(tm).refinement)
        ran.append(fxckpt.inspect(tm)._dispatcher._latest_plans())
    return made, results, ran


@pytest.mark.parametrize("capture", ["graph", "dynamo"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("value", [0.25, 4.0])
def test_a_refined_plan_is_made_once_and_gives_the_same_bits(
        factor: Factor, name: str, capture: str, value: float) -> None:
    factor.value = value
    made, results, ran = _train(name, capture)
    assert all(r is None for r in results[:REFINED_AT])
    assert made[REFINED_AT] == made[REFINED_AT - 1] + made[0]  # every plan once more
    assert made[REFINED_AT:] == [made[REFINED_AT]] * (STEPS - REFINED_AT)  # and never again
    result = results[-1]
    assert isinstance(result, Refinement)
    assert result.replanned and result.factor == result.measured == value
    assert result.steps == TIMED
    assert result.runs >= 1 and result.seconds > 0 and result.predicted > 0
    before, after = ran[REFINED_AT - 1], ran[REFINED_AT]
    assert len(before) == len(after) == made[0]  # each graph's plan made again
    assert all(p is not q for p, q in zip(before, after))
    decisions = [[[(s.nodes, s.keeps, s.action) for s in p.segments] for p in plans]
                 for plans in (before, after)]
    assert result.changed == (decisions[0] != decisions[1])
    assert ran[-1] == after  # the new plans serve every later step
    note = f"ops priced at x{value:.2f} their measured prices"
    assert all(any(note in n for n in p.notes) for p in after)
    assert not any(note in n for p in before for n in p.notes)
    assert ("the plans changed" if result.changed else "the same plans came out") in str(result)
    # the timed steps' passes, and the timed plans they are set against
    assert result.forward_seconds and result.backward_seconds and result.span_seconds
    # medians over the steps: each step's span holds its forward and its backward
    assert result.span_seconds >= max(result.forward_seconds, result.backward_seconds)
    assert result.segments == sum(len(p.segments) for p in before)
    recompute = sum(p.predicted_recompute or 0.0 for p in before)
    forward = sum((p.predicted_recompute or 0.0) / p.recompute_share for p in before
                  if p.recompute_share)
    assert result.recompute_share == pytest.approx(recompute / forward)
    assert result.forward_price == pytest.approx(forward / TABLE_RATE)  # the suite's prices
    assert "a step took" in str(result)


def test_dearer_ops_make_a_plan_of_more_segments_that_recomputes_less(factor: Factor) -> None:
    """Ops priced at four times: a segment's fixed overhead weighs a quarter as much against
    the recompute it saves, so the plan at the same budget splits the run into more segments."""
    factor.value = 4.0
    made, results, ran = _train("mlp", "graph", budget=0.7)
    first, last = ran[0][0], ran[-1][0]
    assert results[-1].changed
    assert len(last.segments) > len(first.segments)
    assert last.recompute_share < first.recompute_share
    assert last.peak_bytes <= last.budget_bytes


def test_within_the_tolerance_nothing_is_planned_again(factor: Factor) -> None:
    factor.value = 1 + TOLERANCE / 2
    made, results, _ = _train("mlp", "graph")
    assert made == [made[0]] * STEPS
    result = results[-1]
    assert result is not None and not result.replanned and result.factor == 1.0
    assert result.measured == 1 + TOLERANCE / 2
    assert result.changed is None and "plans unchanged" in str(result)


def test_a_plan_without_segments_times_nothing(factor: Factor) -> None:
    factor.value = 4.0
    made, results, ran = _train("mlp", "graph", budget=1.0)
    assert not ran[-1][0].segments
    assert made == [made[0]] * STEPS
    assert results[-1].runs == 0 and not results[-1].replanned
    assert "no checkpointed segment ran" in str(results[-1])


def test_calls_inside_a_compiled_region_are_never_counted(
        factor: Factor, monkeypatch: pytest.MonkeyPatch) -> None:
    factor.value = 4.0
    torch.manual_seed(0)
    tm = fxckpt.transform(mlp(), budget=0.5, capture="graph")
    x = torch.randn(4, 16, 32)
    tm(x).sum().backward()  # the first call: counted
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(STEPS):
        tm(x).sum().backward()
    assert fxckpt.inspect(tm)._dispatcher.refiner.calls == 1
    assert fxckpt.inspect(tm).refinement is None


def test_eval_and_no_grad_calls_are_not_training_steps(factor: Factor) -> None:
    factor.value = 4.0
    tm = fxckpt.transform(mlp(), budget=0.5, capture="graph")
    x = torch.randn(4, 16, 32)
    with torch.no_grad():
        for _ in range(STEPS):
            tm(x)
    tm.eval()
    for _ in range(STEPS):
        tm(x)
    assert fxckpt.inspect(tm)._dispatcher.refiner.calls == 0


def _config(**options: object) -> TransformConfig:
    return TransformConfig.from_options(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options,device,env,expected", [
    ({"budget": 0.5}, "cpu", {ENV: "measured"}, True),
    ({"budget": "1GiB"}, "cpu", {ENV: "measured"}, True),
    ({"budget": 0.5}, "cpu", {ENV: "table"}, False),  # the same plan on every machine
    ({"budget": 0.5, "device_profile": "cpu"}, "cpu", {ENV: "measured"}, False),
    ({"budget": 0.5, "device_profile": "h100"}, "cuda:0", {}, False),
    ({"budget": 0.5}, "cuda:0", {}, True),
    ({"budget": 0.5}, "cuda:0", {"WORLD_SIZE": "2"}, False),  # every rank the same plan
    ({"budget": 0.5}, "cpu", {ENV: "measured", "WORLD_SIZE": "4"}, False),
    ({"budget": 0.5}, "meta", {ENV: "measured"}, False),
    ({"every": 2}, "cpu", {ENV: "measured"}, False),  # no solver: nothing to weigh
    ({"budget": 0.5, "chunks": 2}, "cpu", {ENV: "measured"}, False),  # stages cut by segments
])
def test_prices_are_refined_only_where_measured_here_and_solved(
        monkeypatch: pytest.MonkeyPatch, options: dict, device: str, env: dict,
        expected: bool) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert refines(_config(**options), device) is expected


def test_the_suite_s_table_prices_never_refine() -> None:
    tm = fxckpt.transform(mlp(), budget=0.5, capture="graph")
    x = torch.randn(4, 16, 32)
    for _ in range(STEPS):
        tm(x).sum().backward()
    assert fxckpt.inspect(tm).refinement is None
    assert fxckpt.inspect(tm)._dispatcher.refiner.on is False


def test_measured_prices_are_refined_from_the_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user runs it: prices measured here, three steps timed, the factor measured."""
    monkeypatch.setenv(ENV, "measured")
    made, results, ran = _train("mlp", "graph")
    result = results[-1]
    assert all(r is None for r in results[:REFINED_AT]) and result is not None
    segments = len(ran[0][0].segments)
    assert segments and result.runs == segments  # each segment once in the fastest step
    assert result.seconds > 0 and result.predicted > 0
    overhead = result.runs * FORWARD_SHARE * cpu_profile().segment  # in the timed runs
    ops = (result.seconds - overhead) / (result.predicted - overhead)
    assert result.measured == pytest.approx(min(max(ops, LIMITS[0]), LIMITS[1]))
    if result.replanned:
        assert abs(result.measured - 1) > TOLERANCE and made[-1] == 2 * made[0]
        assert result.factor == result.measured
    else:
        assert result.factor == 1.0 and made[-1] == made[0]


def test_plan_for_plans_at_the_prices_the_steps_refined() -> None:
    x = torch.randn(*MODELS["mlp"][1])
    segments = []
    for refined_factor in (1.0, 4.0):
        torch.manual_seed(0)
        tm = fxckpt.transform(mlp(), budget=0.7, capture="graph")
        fxckpt.inspect(tm)._dispatcher.refiner.factor = refined_factor  # as the steps left it
        segments.append(len(fxckpt.inspect(tm).plan_for(x).segments))
    assert segments == [1, 2]  # the plans of test_dearer_ops_make_a_plan_of_more_segments


def test_moving_the_model_measures_again(factor: Factor) -> None:
    factor.value = 4.0
    tm = fxckpt.transform(mlp(), budget=0.5, capture="graph")
    x = torch.randn(*MODELS["mlp"][1])
    for _ in range(STEPS):
        tm(x).sum().backward()
    assert fxckpt.inspect(tm).refinement is not None
    tm.double()
    assert fxckpt.inspect(tm).refinement is None
    for _ in range(STEPS):
        tm(x.double()).sum().backward()
    assert fxckpt.inspect(tm).refinement is not None


# What users train, through the default path, across the step that plans again: the same bits.

def _side_by_side(make: Callable[[], nn.Module], inputs: Callable[[int], tuple], budget: float,
                  capture: str = "auto",
                  one_size: bool = True) -> tuple[list[int], nn.Module, nn.Module]:
    """Eager and transformed for STEPS steps: the same bits at every one. With ``one_size``,
    every graph the call before the refining one ran is planned again at it, and nothing
    after it."""
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    reference = make()
    tm = fxckpt.transform(model, budget=budget, capture=capture)
    made, ran = [], []
    for step in range(STEPS):
        args = inputs(step)
        assert_steps_equal(run_step(tm, args, {}, seed=step),
                           run_step(reference, args, {}, seed=step))
        made.append(fxckpt.inspect(tm)._dispatcher.counts.plans)
        ran.append(len(fxckpt.inspect(tm)._dispatcher._latest_plans()))
    result = fxckpt.inspect(tm).refinement
    assert result is not None and result.replanned == (result.runs > 0)
    if result.replanned and one_size:
        assert made[REFINED_AT] - made[REFINED_AT - 1] == ran[REFINED_AT - 1]
        assert made[REFINED_AT:] == [made[REFINED_AT]] * (STEPS - REFINED_AT)
    return made, model, reference


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p.error is None],
                         ids=lambda p: p.name)
def test_every_fidelity_pattern_keeps_its_bits_across_the_plan_made_again(
        factor: Factor, pattern: Pattern) -> None:
    factor.value = 4.0
    args, _ = pattern.inputs()
    made, model, reference = _side_by_side(pattern.make, lambda step: args, pattern.budget)
    if hasattr(model, "hook_log"):  # hooks fire once per forward, planned again or not
        assert model.hook_log.calls == reference.hook_log.calls


class Checked(nn.Module):
    """A forward that checks a value between its halves (a data-dependent branch): two Dynamo
    graphs, each planned again."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = mlp(), mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if x.abs().max() > 1e4:
            x = x / 1e4
        return self.second(x)


def test_each_graph_of_a_broken_forward_is_planned_again(factor: Factor) -> None:
    factor.value = 4.0
    x = torch.randn(*MODELS["mlp"][1])
    made, model, reference = _side_by_side(Checked, lambda step: (x,), 0.5)
    assert made[0] >= 2 and made[-1] == made[0] + made[0]


def test_a_hugging_face_gpt2_keeps_its_bits_across_the_plan_made_again(factor: Factor) -> None:
    factor.value = 4.0
    ids = torch.randint(0, 64, (4, 32))
    made, _, _ = _side_by_side(lambda: gpt2(layers=4), lambda step: (ids,), 0.5)
    assert made[-1] > made[0]


def test_a_batch_that_changes_while_timed_is_planned_again_once(factor: Factor) -> None:
    """Calls of several sizes under a budget: several plans, all dropped once, and each size
    planned again at its next call."""
    factor.value = 4.0
    sizes = [4, 8, 4, 8, 4, 8, 4]
    made, _, _ = _side_by_side(mlp, lambda step: (torch.randn(sizes[step], 16, 32),), 0.5,
                               capture="graph", one_size=False)
    assert made == [1, 2, 2, 2, 3, 4, 4]  # one plan per size; each made again at its next call


def test_a_refinement_predicts_the_step_of_another_plan_from_its_own() -> None:
    """Timed: a step of 150 ms (forward 40 ms, backward 100 ms), with a plan of 4 segments
    recomputing 30% of a forward priced at 20 ms (6 ms; 9 ms at the x1.5 its segments measured)
    and 2 ms of overhead a segment (8 ms): 136 ms of the 150 are the step without checkpoints
    (133 ms at x1.5)."""
    r = Refinement(TIMED, 4, 0.02, 0.018, 1.5, 1.5, True, forward_seconds=0.04,
                   backward_seconds=0.1, span_seconds=0.15, recompute_share=0.3, segments=4,
                   forward_price=0.02, overhead=0.002)
    assert r.recompute_seconds(0.3) == pytest.approx(0.006)
    assert r.recompute_seconds(0.3, r.measured) == pytest.approx(0.009)
    assert r.base_seconds() == pytest.approx(0.136)
    assert r.base_seconds(r.measured) == pytest.approx(0.133)
    assert r.step_seconds(0.0, 0) == pytest.approx(0.136)
    for factor in (1.0, r.measured):  # its own plan: its own step, at either price
        assert r.step_seconds(0.3, 4, factor) == pytest.approx(0.15)
    assert r.step_seconds(0.5, 10) == pytest.approx(0.136 + 0.5 * 0.02 + 10 * 0.002)
    assert r.step_seconds(0.5, 10, 1.5) == pytest.approx(0.133 + 0.5 * 0.02 * 1.5 + 10 * 0.002)
    assert "a step took 150.0 ms from the call to the end of its backward" in str(r)
    assert "(forward 40.0 ms, backward 100.0 ms)" in str(r)
    assert "6.0 ms of recompute and 8.0 ms of segment overhead" in str(r)
    assert str(r).endswith("136.0 ms without them")
    unseen = dataclasses.replace(r, backward_seconds=None, span_seconds=None)  # no backward
    assert unseen.base_seconds() is None and unseen.step_seconds(0.3, 4) is None
    assert "a step's" not in str(unseen)
    unpriced = dataclasses.replace(r, forward_price=None)  # its plans recomputed nothing
    assert unpriced.recompute_seconds(0.3) is None and unpriced.step_seconds(0.0, 0) is None


def test_the_timed_backward_is_the_module_s_not_the_loss_s(factor: Factor) -> None:
    """A gradient hook on the input sleeps 50 ms inside the module's backward; the loss's own
    backward sleeps 300 ms outside it."""
    torch.manual_seed(0)
    tm = fxckpt.transform(mlp(), budget=0.5, capture="graph")
    for _ in range(WARMUP + TIMED + 1):
        x = torch.randn(*MODELS["mlp"][1], requires_grad=True)
        x.register_hook(lambda g: time.sleep(0.05))
        Slow.apply(tm(x), 0.0, 0.3).sum().backward()
    result = fxckpt.inspect(tm).refinement
    assert result is not None and result.runs
    assert result.backward_seconds is not None and 0.05 <= result.backward_seconds < 0.3
    assert result.forward_seconds is not None and 0 < result.forward_seconds < 0.3
    assert result.span_seconds is not None and result.span_seconds >= 0.05 + 0.3  # loss's in
"""The strategies' segments: where every= cuts, what depth= groups, what force pins."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.config import TransformConfig
from fxckpt.errors import PlanError
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.planning.select import select
from models import MLP, UNet
from support import assert_steps_equal, run_step


def _plan(model: nn.Module, x: torch.Tensor, **options) -> fxckpt.Plan:
    captured = capture(model, (x,), {})
    annotate(captured.gm, captured.graph_args((x,), {}))
    config = TransformConfig.from_options(**options).validate(model)
    return select(captured.gm, config, capture=captured.method, training=True, signature="")


def test_every_counts_units_of_work() -> None:
    plan = _plan(MLP(depth=8), torch.randn(4, 32), every=4)
    assert [len([n for n in s.nodes if n.endswith("_fc")]) for s in plan.segments] == [4, 4]
    assert (
        plan.segments[0].nodes[0] == "layers_0_fc" and plan.segments[1].nodes[0] == "layers_4_fc"
    )


class ViewChain(nn.Module):
    """Units that start with an in-place matmul into a view of the previous unit's result."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            y = fc(x).view(4, 8)
            x = y.addmm_(x, fc.weight).view(4, 4, 2).transpose(1, 2).relu_().reshape(4, 8) + 0
        return x


def test_every_never_cuts_inside_a_view_chain_or_inplace_op() -> None:
    x = torch.randn(4, 8)
    plan = _plan(ViewChain(), x, every=1)
    for seg in plan.segments:
        first = seg.nodes[0]
        assert not first.startswith(("view", "addmm_", "transpose", "relu_", "reshape")), seg.nodes
    assert [s.nodes[0] for s in plan.segments][1:] == ["fcs_1", "fcs_2", "fcs_3"]


class InplaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h2 = self.b(h.relu())
        h.mul_(
            2
        )  # writes a tensor made before b's unit: must not be inside a segment that reads h
        return (h2 * h).sum(dim=1)


def test_segment_never_writes_its_input_in_place() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plan = _plan(InplaceOnInput(), x, depth=1, force={"b": "recompute"})
    for seg in plan.segments:
        assert "mul_" not in seg.nodes or "a" in seg.nodes
    model = InplaceOnInput()
    import copy

    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))


def test_depth_groups_unet_blocks_and_carries_skips() -> None:
    plan2 = _plan(UNet(), torch.randn(2, 1, 8, 8), depth=2)
    assert [s.module_paths for s in plan2.segments] == [
        ("down.0",),
        ("down.1",),
        ("up.0",),
        ("up.1",),
    ]
    up0 = plan2.segments[2]
    assert len(up0.inputs) == 2  # the decoder input and the skip from the encoder


def test_depth_1_on_single_layers_says_each_candidate_keeps_what_it_would_free() -> None:
    torch.manual_seed(0)
    flat = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    plan = _plan(flat, torch.randn(4, 8), depth=1)
    assert plan.segments == ()
    assert plan.notes == (
        "nothing is checkpointed: each of the 4 candidate segment(s) keeps what it would free "
        "(every tensor it makes is used after it, as with one layer of a flat nn.Sequential); "
        "group several layers per segment with every=N or budget=",)
    assert len(_plan(flat, torch.randn(4, 8), every=2).segments) == 1  # the hint works


class UnusedDeep(nn.Module):
    """Its only module deeper than the root is never called: depth=2 finds no candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).relu() + 1


def test_no_candidate_at_all_still_says_the_strategy_found_none() -> None:
    plan = _plan(UnusedDeep(), torch.randn(4, 8), depth=2)
    assert plan.segments == ()
    assert plan.notes == ("nothing is checkpointed: the strategy found no segment",)


def test_a_byte_budget_the_unmodified_step_meets_is_met_without_a_search(monkeypatch) -> None:
    import fxckpt.solver.portfolio as portfolio

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched for a plan although the unmodified step fits")

    monkeypatch.setattr(portfolio, "solve_shared", no_search)
    monkeypatch.setattr(portfolio, "solve_selective", no_search)
    x = torch.randn(8, 32)
    tm = fxckpt.transform(MLP(), budget="1GiB", example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert plan.segments == () and plan.verified_peak == plan.verified_eager_peak
    with pytest.raises(PlanError, match="searched for a plan"):  # the control: a real search
        fxckpt.transform(MLP(), budget=0.5, example_inputs=(x,))

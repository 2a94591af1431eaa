"""The partition pass: balanced stages, explicit balance, and stage GraphModules that carry
skips."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
import torch.nn as nn

from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.passes.lower import lower
from fxckpt.planning.select import select
from fxckpt.cost.annotate import info
from fxckpt.pipeline.partition import legal_cuts, node_costs, partition, stage_order
from fxckpt.pipeline.split import split_stages
from fxckpt.plan import Plan
from fxckpt.solver.stages import stage_costs
from models import MLP, UNet


class Uneven(nn.Module):
    """Linear layers of very different widths: an even split by node count would be unbalanced."""

    widths = (16, 64, 8, 128, 16, 32, 8, 96, 16, 8)

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(self.widths, self.widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return x


def _graph(model: nn.Module, x: torch.Tensor, every: Optional[int] = None, lowered: bool = False):
    captured = capture(model, (x,), {})
    annotate(captured.gm, [x])
    plan = None
    if every is not None:
        plan = select(
            captured.gm,
            TransformConfig.from_options(every=every),
            capture=captured.method,
            training=True,
            signature="",
        )
        if lowered:
            lower(captured.gm, plan)
    return captured.gm, plan


def _chain(stages: list, *inputs: torch.Tensor):
    value = stages[0](*inputs)
    for s in stages[1:]:
        value = s(*value)
    return value


def _exhaustive(costs: list, stages: int, allowed: list) -> float:
    return min(
        max(stage_costs(costs, cuts)) for cuts in itertools.combinations(allowed, stages - 1)
    )


@pytest.mark.parametrize("k", [2, 3, 4])
def test_balanced_stages_are_as_good_as_exhaustive_search(k: int) -> None:
    gm, _ = _graph(Uneven(), torch.randn(4, 16))
    sp = partition(gm, k)
    costs = node_costs(gm)
    best = _exhaustive(costs, k, legal_cuts(gm))
    assert sp.bottleneck <= 1.05 * best and sp.bottleneck == best
    assert sum(sp.costs) == sum(
        info(n).flops for n in stage_order(gm)
    )  # costs are the annotated FLOPs
    naive = partition(
        gm, balance=[len(costs) // k] * (k - 1) + [len(costs) - (len(costs) // k) * (k - 1)]
    )
    assert sp.bottleneck < naive.bottleneck  # equal node counts are worse on uneven layers
    assert len(str(sp).splitlines()) == k + 2 and sp.to_dict()["method"] == "balanced"


def test_balance_by_memory() -> None:
    gm, _ = _graph(Uneven(), torch.randn(4, 16))
    sp = partition(gm, 2, cost="memory")
    assert sp.cost == "memory" and sum(sp.costs) == sum(info(n).new_bytes for n in stage_order(gm))
    with pytest.raises(
        ConfigError, match=r"cost must be one of \('flops', 'memory'\) \(got 'time'\)"
    ):
        partition(gm, 2, cost="time")


def test_stages_carry_values_that_skip_stages() -> None:
    x = torch.randn(2, 1, 8, 8)
    model = UNet()
    gm, _ = _graph(model, x)
    sp = partition(gm, 3)
    stages = split_stages(gm, sp.stage_of)
    assert torch.equal(_chain(stages, x), gm(x))
    nodes = {n.name: n for n in gm.graph.nodes}
    skips = [name for name, s in sp.stage_of.items()
             if s == 0 and any(sp.stage_of.get(u.name) == 2 for u in nodes[name].users)]
    assert skips, "the U-Net should have a skip from stage 0 to stage 2"
    middle = stages[1].meta["fxckpt_stage"]
    for name in skips:
        assert name in middle["inputs"] and name in middle["outputs"]
    shared = {id(p) for s in stages for p in s.parameters()}
    assert shared == {id(p) for p in model.parameters()}  # the same Parameter objects, not copies


def test_checkpoint_segments_stay_in_one_stage_and_cost_their_recompute() -> None:
    x = torch.randn(4, 32)
    gm, plan = _graph(MLP(depth=6), x, every=2)
    assert isinstance(plan, Plan) and plan.segments
    sp = partition(gm, 4, plan=plan)
    for seg in plan.segments:
        assert len({sp.stage_of[name] for name in seg.nodes}) == 1, seg.name
    assert sum(sp.costs) == plan.total_flops + plan.recompute_flops


def test_lowered_graphs_split_around_checkpoint_calls() -> None:
    x = torch.randn(4, 32)
    torch.manual_seed(0)
    gm, plan = _graph(MLP(depth=6, p=0.0), x, every=2, lowered=True)
    assert plan is not None
    sp = partition(gm, 3, plan=plan)
    assert sum(sp.costs) == plan.total_flops + plan.recompute_flops
    stages = split_stages(gm, sp.stage_of)
    calls = [
        n
        for s in stages
        for n in s.graph.nodes
        if n.op == "get_attr" and n.target.startswith("segment_")
    ]
    assert sorted(c.target for c in calls) == sorted(seg.name for seg in plan.segments)
    torch.testing.assert_close(_chain(stages, x), gm(x), rtol=0, atol=0)


def test_balance_by_node_counts_and_module_paths() -> None:
    gm, _ = _graph(MLP(depth=6), torch.randn(4, 32))
    n = len(stage_order(gm))
    by_count = partition(gm, balance=[n - 4, 4])
    assert [len(s) for s in by_count.nodes] == [n - 4, 4]
    by_path = partition(gm, balance=["layers.2", "layers.4"])
    assert [s[0] for s in by_path.nodes] == ["layers_0_fc", "layers_2_fc", "layers_4_fc"]
    assert by_path.module_paths[1] == ("layers.2", "layers.3")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"balance": [3, 3]},
            r"balance must sum to the graph's 19 compute node\(s\) "
            r"\(got \[3, 3\], which sums to 6\)",
        ),
        ({"balance": [19, 0]}, r"integers >= 1"),
        ({"balance": ["layer.2"]}, r"balance boundary 'layer.2' names no module.*did you mean"),
        ({"balance": [10, 9], "stages": 3}, r"balance describes 2 stage\(s\) but stages=3"),
        ({"stages": 20}, r"cannot cut 19 node\(s\) into 20 non-empty stages"),
        ({"stages": 0}, r"positive integer \(got 0\)"),
        ({}, r"give the number of stages"),
    ],
)
def test_bad_partition_arguments(kwargs: dict, message: str) -> None:
    gm, _ = _graph(MLP(depth=6), torch.randn(4, 32))
    assert len(stage_order(gm)) == 19
    with pytest.raises(ConfigError, match=message) as e:
        partition(gm, **kwargs)
    assert isinstance(e.value, ValueError)


def test_split_rejects_stages_that_are_not_contiguous() -> None:
    gm, _ = _graph(MLP(depth=2), torch.randn(4, 32))
    names = [n.name for n in stage_order(gm)]
    with pytest.raises(ConfigError, match="stages must be contiguous"):
        split_stages(gm, {name: i % 2 for i, name in enumerate(names)})
    with pytest.raises(ConfigError, match="missing"):
        split_stages(gm, {names[0]: 0})


class Flatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return self.fc(h.reshape(b * s, 8)).reshape(b, s, 8)


class Reshaping(nn.Module):
    """Sizes read early and used late; a Python test on a size, so torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 8), Flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        if b > 0:  # symbolic_trace cannot branch on a size: export captures, with dynamic dims
            x = x * 2
        return self.head(self.fc(x), b, s)


def test_sizes_are_read_off_carried_tensors_not_sent() -> None:
    """An exported graph's ``sym_size`` values are not tensors: the next stage reads them off a
    tensor it receives instead, so only tensors cross stage boundaries (as pipelining needs)."""
    model, x = Reshaping(), torch.randn(4, 3, 4)
    captured = capture(model, (x,), {})
    assert captured.method == "export" and captured.shape_free
    annotate(captured.gm, captured.graph_args((x,), {}))
    stages = split_stages(captured.gm, partition(captured.gm, balance=["head"]).stage_of)
    carried = [n for n in stages[1].graph.nodes if n.op == "placeholder"]
    assert carried and all(info(n).is_tensor for n in carried), [n.name for n in carried]
    x = torch.randn(5, 2, 4)  # another batch and sequence length
    (out,) = stages[1](*stages[0](x))  # exported graphs' stages: flat inputs, a flat output
    torch.testing.assert_close(out, model(x))

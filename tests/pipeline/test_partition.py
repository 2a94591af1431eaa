"""The partition pass: balanced stages, explicit balance, checkpoint segments kept in one stage
(the stage GraphModules themselves: test_split.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from fxckpt.errors import ConfigError
from fxckpt.cost.annotate import info
from fxckpt.pipeline.partition import legal_cuts, node_costs, partition, stage_order
from fxckpt.plan import Plan
from fxckpt.solver.stages import stage_costs
from models import MLP
from stage_graphs import annotated_graph as _graph


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


def test_checkpoint_segments_stay_in_one_stage_and_cost_their_recompute() -> None:
    x = torch.randn(4, 32)
    gm, plan = _graph(MLP(depth=6), x, every=2)
    assert isinstance(plan, Plan) and plan.segments
    sp = partition(gm, 4, plan=plan)
    for seg in plan.segments:
        assert len({sp.stage_of[name] for name in seg.nodes}) == 1, seg.name
    assert sum(sp.costs) == plan.total_flops + plan.recompute_flops


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

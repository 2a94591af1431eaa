"""planning/anchors.py: capture-independent node names and finding a plan's segments by them."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn
import pytest

from fxckpt.errors import PlanError
from fxckpt.cost.annotate import annotate
from fxckpt.planning.anchors import anchors_of, remap, target_name
from fxckpt.cost.annotate import planned_nodes
from handmade import Tiny, traced


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * 2.0) * 3.0


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Twice(), Twice()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _order(model: nn.Module) -> list[torch.fx.Node]:
    x = torch.randn(3, 4)
    return list(planned_nodes(annotate(traced(model, x), [x]).graph))


def test_anchors_name_module_op_and_occurrence() -> None:
    got = anchors_of(_order(Tiny()))
    assert got == {
        "fc1": "fc1|fc1|0", "relu": "|torch.relu|0", "fc2": "fc2|fc2|0",
        "tanh": "|torch.tanh|0", "mul": "|_operator.mul|0", "add": "|_operator.add|0",
        "drop": "drop|drop|0", "head": "head|head|0"}


def test_repeated_ops_are_counted_per_module() -> None:
    got = list(anchors_of(_order(Stack())).values())
    assert got == [
        "layers.0|_operator.mul|0", "layers.0|torch.sin|0", "layers.0|_operator.mul|1",
        "layers.1|_operator.mul|0", "layers.1|torch.sin|0", "layers.1|_operator.mul|1"]


def test_target_name_is_stable_text() -> None:
    assert target_name("fc1") == "fc1"
    assert target_name(torch.ops.aten.mul.Tensor) == "aten.mul.Tensor"
    assert target_name(torch.arange) == "torch.arange"

    class Odd:
        __name__ = "odd"

        def __call__(self) -> None:
            pass

        @property
        def __module__(self) -> str:  # type: ignore[override]
            raise RuntimeError("no module")

    name = target_name(Odd())
    assert name == f"{Odd.__qualname__}.odd" and "0x" not in name


def test_remap_finds_runs_and_keeps_by_anchor() -> None:
    order = _order(Tiny())
    anchors = anchors_of(order)
    spec = (anchors["relu"], anchors["add"], anchors["tanh"], anchors["head"])
    runs, keeps = remap(order, [("seg_0", spec)])
    assert [[n.name for n in r] for r in runs] == [["relu", "fc2", "tanh", "mul", "add"]]
    assert keeps == ["tanh"]  # head is outside the run; it is not kept


def test_remap_follows_renamed_nodes_in_another_capture() -> None:
    order = _order(Tiny())
    anchors = anchors_of(order)
    other = _order(Tiny())
    for n in other:  # another capture numbers its nodes differently
        n.name = n.name + "_7"
    runs, keeps = remap(other, [("seg_0", (anchors["fc2"], anchors["mul"], anchors["tanh"]))])
    assert [[n.name for n in r] for r in runs] == [["fc2_7", "tanh_7", "mul_7"]]
    assert keeps == ["tanh_7"]


def test_a_kept_node_this_graph_lacks_is_dropped() -> None:
    order = _order(Tiny())
    a = anchors_of(order)
    _, keeps = remap(order, [("seg_0", (a["fc1"], a["relu"], "fc9|fc9|0"))])
    assert keeps == []


def test_remap_refuses_a_segment_without_anchors() -> None:
    with pytest.raises(PlanError, match="seg_3 has no anchors"):
        remap(_order(Tiny()), [("seg_3", ("fc1|fc1|0",))])


@pytest.mark.parametrize("ends", [("nope|x|0", "head|head|0"), ("fc1|fc1|0", "nope|x|0")])
def test_remap_refuses_a_missing_end(ends: tuple[str, str]) -> None:
    with pytest.raises(PlanError, match="starts or ends at 'nope\\|x\\|0'.*another model"):
        remap(_order(Tiny()), [("seg_0", ends)])


def test_remap_refuses_ends_in_the_wrong_order() -> None:
    with pytest.raises(PlanError, match="starts or ends at 'fc1\\|fc1\\|0'"):
        remap(_order(Tiny()), [("seg_0", ("head|head|0", "fc1|fc1|0"))])

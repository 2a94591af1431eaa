"""planning/blocks.py: the op ranges of a graph that come from a module list's items."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
import torch.nn as nn

from fxckpt.cost.annotate import META_KEY, annotate, info, planned_nodes
from fxckpt.planning.blocks import block_of, block_ranges
from fxckpt.cost.bridge import problem_of
from handmade import traced


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    """stem(fc) -> layers.0 (fc, tanh) -> relu (root) -> layers.1 (fc, tanh) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.stem(x))
        return self.head(self.layers[1](torch.relu(h)))


def test_block_of_cuts_at_the_first_number() -> None:
    assert block_of("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert block_of("layer2.1.conv1") == "layer2.1"
    assert block_of("0.fc") == "0"
    assert block_of("encoder.norm") is None
    assert block_of("") is None


def _setup() -> tuple[list[torch.fx.Node], object]:
    x = torch.randn(2, 4)
    gm = annotate(traced(Stack(), x), [x])
    return list(planned_nodes(gm.graph)), gm


def test_block_ranges_one_per_contiguous_item() -> None:
    order, gm = _setup()
    problem = problem_of(gm)  # type: ignore[arg-type]
    names = [op.name for op in problem.ops]
    assert [info(n).module_path for n in order] == [
        "stem", "layers.0.fc", "layers.0", "", "layers.1.fc", "layers.1", "head"]
    got = block_ranges(problem, order)
    assert [names[a:b] for a, b in got] == [
        [order[1].name, order[2].name], [order[4].name, order[5].name]]


def test_glue_inside_a_block_does_not_break_it() -> None:
    order, gm = _setup()
    relu = order[3]
    relu.meta[META_KEY] = dataclasses.replace(info(relu), module_path="")
    # layers.1's nodes join layers.0: only root glue (relu) sits between the two stretches
    for n in order[4:6]:
        n.meta[META_KEY] = dataclasses.replace(info(n), module_path="layers.0.x")
    problem = problem_of(gm)  # type: ignore[arg-type]
    assert block_ranges(problem, order) == [(1, 6)]


def test_an_interrupted_block_is_left_out() -> None:
    order, gm = _setup()
    for n in order[4:6]:  # layers.0 again, after a node of another module
        n.meta[META_KEY] = dataclasses.replace(info(n), module_path="layers.0.x")
    order[3].meta[META_KEY] = dataclasses.replace(info(order[3]), module_path="other")
    problem = problem_of(gm)  # type: ignore[arg-type]
    assert block_ranges(problem, order) == []

"""The record annotate leaves on each node, and how it is read (fxckpt.cost.node_info)."""

from __future__ import annotations

import pytest
import torch
import torch.fx

import fxckpt
from fxckpt.cost.node_info import _normalise_path, has_info, info, module_path_of


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_a_graph_not_annotated_says_to_run_annotate_first() -> None:
    gm = torch.fx.symbolic_trace(_Two())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert not has_info(node)
    with pytest.raises(fxckpt.PlanError, match="has no fxckpt annotation; run annotate first"):
        info(node)
    assert module_path_of(node) == "fc"  # a call_module's path is its target


@pytest.mark.parametrize("path, want", [
    ("L['self'].layers[0].fc", "layers.0.fc"), ("layers.0.fc", "layers.0.fc"),
    ("L['args'][0].2", "2"), ("L['self'].__dict__['_modules']['model'].fc", "model.fc"),
])
def test_module_paths_read_alike_from_every_capture(path: str, want: str) -> None:
    assert _normalise_path(path) == want

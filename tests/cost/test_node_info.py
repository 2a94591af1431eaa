"""The record annotate leaves on each node, and how it is read (fxckpt.cost.node_info)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx

import fxckpt
from fxckpt.cost.node_info import (_normalise_path, has_info, info, model_stack,
                                   module_path_of)


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


class _Rotate(torch.nn.Module):
    """A library's function made a module and kept at module level, as transformers 5.25 keeps
    ``apply_rotary_pos_emb`` (a hub-kernel wrapper)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., 1:], x[..., :1]], -1) * 0.5


ROTATE = _Rotate()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(ROTATE(self.fc(x))) + x


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_dynamo_reached_as_a_global_is_not_a_module_path_of_the_model() -> None:
    gm = torch.fx.symbolic_trace(_Two())
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["nn_module_stack"] = {
        "1": ("L['self'].layers[0]", _Block),
        "2": ("G['lib'].apply_rotary_pos_emb", _Rotate),
    }
    assert model_stack(node) == [("L['self'].layers[0]", _Block)]
    assert module_path_of(node) == "layers.0"
    # captured by Dynamo, each block is one segment, the global module's ops in it
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2, capture="dynamo")
    tm(x).sum().backward()
    reference(x).sum().backward()
    assert [s.module_paths for s in fxckpt.inspect(tm).plan.segments] == \
        [("layers.0",), ("layers.1",), ("layers.2",)]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name

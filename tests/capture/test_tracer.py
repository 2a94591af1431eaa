"""capture/tracer.py: the symbolic tracer made faithful for training."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn

from fxckpt.capture.tracer import (ORIGINAL_PATH, FxckptTracer, function_call, function_of,
                                   to_graph_module)
from fxckpt.errors import CaptureError


class StraightThrough(torch.autograd.Function):
    """Rounds in forward; passes the gradient straight through in backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Quantised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return StraightThrough.apply(self.fc(x)) * 0.5 ** self.step


def _traced(model: nn.Module) -> torch.fx.GraphModule:
    return to_graph_module(model, FxckptTracer().trace(model), type(model).__name__)


def test_a_custom_function_is_one_node_that_runs_its_own_backward() -> None:
    model = Quantised()
    gm = _traced(model)
    calls = [n for n in gm.graph.nodes if function_of(n.target) is StraightThrough]
    assert len(calls) == 1 and calls[0].target is function_call(StraightThrough)
    assert calls[0].target.__name__ == "StraightThrough_apply"
    x = torch.randn(2, 3, requires_grad=True)
    gm(x).sum().backward()
    # round has a zero gradient; the Function's straight-through backward gives 0.5 ** step
    expected = torch.full((2, 3), 0.5) @ model.fc.weight
    assert torch.allclose(x.grad, expected)


def test_buffers_written_in_place_are_updated_every_call() -> None:
    model = Quantised()
    gm = _traced(model)
    assert model.step.item() == 0.0  # tracing wrote nothing
    gm(torch.randn(1, 3))
    gm(torch.randn(1, 3))
    assert model.step.item() == 2.0


def test_hooked_modules_are_leaves_called_with_real_tensors() -> None:
    seen: list[type] = []
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model[1].register_forward_hook(lambda m, i, o: seen.append(type(o)))
    gm = to_graph_module(model, FxckptTracer(leaves=frozenset({"1"})).trace(model), "M")
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1"]
    gm(torch.randn(1, 2))
    assert seen == [torch.Tensor]


def test_a_random_draw_no_input_reaches_is_a_node_that_draws_every_call() -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn(3)

    gm = to_graph_module(Noisy(), FxckptTracer().trace(Noisy()), "Noisy")
    assert any(n.target is torch.randn for n in gm.graph.nodes)
    x = torch.zeros(3)
    torch.manual_seed(0)
    first, second = gm(x), gm(x)
    torch.manual_seed(0)
    assert not torch.equal(first, second) and torch.equal(gm(x), first)


def test_a_write_the_tracer_cannot_see_is_refused() -> None:
    class Sneaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for p in self.parameters():
                p.data.mul_(1.0)
            return self.fc(x)

    with pytest.raises(CaptureError, match="writes the model's parameters, buffers or tensor"):
        FxckptTracer().trace(Sneaky())


def test_children_named_like_graph_module_attributes_are_renamed_and_remembered() -> None:
    class Gnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.graph = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.graph(x)

    model = Gnn()
    gm = to_graph_module(model, FxckptTracer().trace(model), "Gnn")
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert call.target == "graph_fxckpt" and call.meta[ORIGINAL_PATH] == "graph"
    x = torch.randn(1, 2)
    assert torch.equal(gm(x), model(x))

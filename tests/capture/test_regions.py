"""Grad-mode and autocast regions and random draws survive symbolic tracing
(fxckpt/capture/regions.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.errors import CaptureError
from fxckpt.capture.regions import is_region_marker, outline_regions
from fxckpt.capture.tracer import FxckptTracer, to_graph_module
from support import assert_steps_equal, run_step

HOP = torch.ops.higher_order


class Islands(nn.Module):
    """A no_grad island, a bf16 island and an fp32 island inside one forward."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            t = self.b(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = self.c(h)
        with torch.autocast("cpu", enabled=False):
            v = self.d(u.float())
        return h * t + v


def _traced(model: nn.Module) -> torch.fx.GraphModule:
    tracer = FxckptTracer()
    return to_graph_module(model, tracer.trace(model), type(model).__name__)


def test_each_region_becomes_one_wrapper_node_and_computes_the_same() -> None:
    model = Islands()
    gm = _traced(model)
    markers = [n.target.__name__ for n in gm.graph.nodes if is_region_marker(n)]
    assert markers == ["_set_grad_enabled", "_set_grad_enabled", "_enter_autocast",
                       "_exit_autocast", "_enter_autocast", "_exit_autocast"]
    assert outline_regions(gm) == 3
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(HOP.wrap_with_set_grad_enabled) == 1
    assert targets.count(HOP.wrap_with_autocast) == 2
    assert not any(is_region_marker(n) for n in gm.graph.nodes)
    x = torch.randn(4, 8, requires_grad=True)
    got, want = gm(x), model(x)
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(o.sum(), x)[0] for o in (got, want)))


@pytest.mark.parametrize("strategy", [{"every": 1}, {"depth": 1}, {}])
def test_regions_are_exact_through_transform(strategy: dict) -> None:
    model = Islands()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, **strategy, capture="graph")
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(2):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    assert fxckpt.inspect(tm).plan.capture == "symbolic_trace"


class Unbalanced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        return self.a(x)


def test_a_forward_that_leaves_grad_off_is_refused() -> None:
    gm = _traced(Unbalanced())
    torch.set_grad_enabled(True)
    with pytest.raises(CaptureError, match="turns gradients off .* leaves them so when it"):
        outline_regions(gm)


class Noisy(nn.Module):
    """Noise drawn without any traced input: the stock tracer bakes it in as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + torch.randn(4, 16) + torch.rand(16)


def test_random_factories_draw_afresh_every_call() -> None:
    model = Noisy()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1)
    x = torch.randn(4, 16)
    outs = []
    for step in range(3):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
        outs.append(tm(x))
    assert not torch.equal(outs[0], outs[1])
    gm = _traced(Noisy())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.randn in targets and torch.rand in targets


class LayerDrop(nn.Module):
    """A Python decision drawn from torch's generator (LayerDrop, stochastic depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training and torch.rand([]) < 0.5:
            return h
        return self.b(h)


def test_a_random_python_decision_is_refused_not_baked_in() -> None:
    tm = fxckpt.transform(LayerDrop(), every=1, capture="graph")
    with pytest.raises(CaptureError, match="could not capture LayerDrop"):
        tm(torch.randn(4, 8))

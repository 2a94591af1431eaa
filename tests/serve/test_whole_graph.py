"""serve/whole_graph.py: one whole graph planned per call: capture once, then annotate, select,
(verify) and lower a copy per plan; stages built on it when asked for."""

from __future__ import annotations

import pytest
import torch

import fxckpt.serve.whole_graph as whole_graph
from fxckpt.config import TransformConfig
from fxckpt.errors import PlanError
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.serve.whole_graph import Compiled, build, capture_for, first_micro_batch, peak_at
from fxckpt.signature import variant_key
from fxckpt.strategy import Every
from handmade import Tiny

X = torch.randn(4, 4)


def _config(**options) -> TransformConfig:
    return TransformConfig(strategy=Every(1), capture="graph", **options)


def test_a_plan_rewrites_a_copy_of_the_captured_graph_and_runs_it() -> None:
    model = Tiny()
    config = _config()
    captured = capture_for(model, config, (X,), {})
    compiled = build(captured, config, (X,), {}, training=True, model=model)
    assert isinstance(compiled, Compiled) and compiled.captured is captured
    assert compiled.gm is not captured.gm and compiled.pipeline is None
    assert not [n for n in captured.gm.graph.nodes if n.target is checkpoint]
    calls = [n for n in compiled.gm.graph.nodes if n.target is checkpoint]
    assert len(calls) == len(compiled.plan.segments) == 2
    assert compiled.variant_key == variant_key(True, (X,), {})
    assert compiled.plan.verified_peak is not None  # a training plan is verified
    torch.manual_seed(0)
    got = compiled((X,), {})
    torch.manual_seed(0)
    assert torch.equal(got, model(X))


def test_the_verified_peak_at_other_inputs() -> None:
    model = Tiny()
    config = _config()
    compiled = build(capture_for(model, config, (X,), {}), config, (X,), {}, training=True,
                     model=model)
    small = peak_at(compiled, config, (X,), {}, model)
    assert small == compiled.plan.verified_peak
    assert peak_at(compiled, config, (torch.randn(64, 4),), {}, model) > small


def test_stages_plan_one_micro_batch_and_refuse_assignments() -> None:
    config = _config(chunks=2, devices=("cpu", "cpu"))
    (args, kwargs) = first_micro_batch(config, (X,), {"m": torch.ones(4, 1)})
    assert args[0].shape == (2, 4) and kwargs["m"].shape == (2, 1)
    assert first_micro_batch(_config(), (X,), {}) == ((X,), {})

    class Keeps(Tiny):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.hidden = torch.relu(self.fc1(x))
            return self.head(self.hidden)

    model = Keeps()
    captured = capture_for(model, config, (X,), {})
    with pytest.raises(PlanError, match=r"^the forward assigns `hidden`, and a pipeline runs it "
                                        r"once per micro-batch"):
        build(captured, config, (X,), {}, training=True, model=model)


def test_a_pipelined_plan_carries_its_stages() -> None:
    model = Tiny()
    config = _config(chunks=2, devices=("cpu", "cpu"))
    compiled = build(capture_for(model, config, (X,), {}), config, (X,), {}, training=True,
                     model=model)
    assert compiled.pipeline is not None and compiled.plan.pipeline is not None
    assert [s.device for s in compiled.plan.pipeline.stages] == ["cpu", "cpu"]
    assert compiled((X,), {}).shape == (4, 2)


def test_a_failure_inside_the_passes_is_a_plan_error_naming_the_model(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise KeyError("node_7")

    monkeypatch.setattr(whole_graph, "select", broken)
    model = Tiny()
    config = _config()
    with pytest.raises(PlanError, match=r"^fxckpt could not plan Tiny \(symbolic_trace graph\) "
                                        r"for \(float32\[4, 4\]\): KeyError: 'node_7'"):
        build(capture_for(model, config, (X,), {}), config, (X,), {}, training=True, model=model)

"""serve/dynamo/backend.py: one Dynamo graph planned by fxckpt's passes (here a traced graph
standing for one) and run by its runtime; the names, inputs and budgets planning reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxckpt.budget import Budget
from fxckpt.config import TransformConfig
from fxckpt.errors import PlanError
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.serve.dynamo.backend import (GraphRecord, GraphRunner, _budget_left, at_smallest,
                                         concrete, plan_graph, state_name, tensor_hooks)
from fxckpt.strategy import Budgeted, Every
from handmade import Tiny


def _placeholder(source: str | None) -> torch.fx.Node:
    node = torch.fx.Graph().placeholder("p")
    if source is not None:
        node.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name=source))
    return node


def test_a_placeholders_source_names_the_parameter_or_buffer_it_stands_for() -> None:
    weight = "L['self']._modules['layers']._modules['0']._parameters['weight']"
    assert state_name(_placeholder(weight)) == "layers.0.weight"
    assert state_name(_placeholder("L['self']._buffers['scale']")) == "scale"
    assert state_name(_placeholder("L['x']")) is None
    assert state_name(_placeholder(None)) is None


def test_concrete_inputs_are_new_leaves_and_sizes_their_values() -> None:
    leaf = torch.ones(2, requires_grad=True)
    made = leaf * 2
    out = concrete([leaf, made, 3])
    assert out[0] is leaf and out[2] == 3
    assert out[1].requires_grad and out[1].grad_fn is not None and out[1] is not made
    assert torch.equal(out[1], made)
    env = ShapeEnv()
    with pytest.raises(PlanError, match="with no value"):
        concrete([env.create_unbacked_symint()])


def test_budgets_in_bytes_are_for_the_whole_step() -> None:
    config = TransformConfig(strategy=Budgeted(Budget(bytes=1000)))
    assert _budget_left(config, 300).budget == Budget(bytes=700)
    assert _budget_left(config, 5000).budget == Budget(bytes=1)
    assert _budget_left(config, 0) is config
    fraction = TransformConfig(strategy=Budgeted(Budget(fraction=0.5)))
    assert _budget_left(fraction, 300) is fraction
    assert at_smallest(fraction, 4096).budget == Budget(bytes=4096)


def test_a_graph_without_register_hook_has_no_tensor_hooks() -> None:
    assert tensor_hooks(torch.fx.symbolic_trace(Tiny())) == {}


def test_plan_graph_plans_and_lowers_a_graph_for_its_inputs() -> None:
    gm = torch.fx.symbolic_trace(Tiny())
    x = torch.randn(3, 4)
    plan, lowered = plan_graph(gm, [x], TransformConfig(strategy=Every(1)), device="cpu")
    assert plan.capture == "dynamo" and plan.segments
    assert plan.signature == "(float32[3, 4])"
    calls = [n for n in lowered.graph.nodes if n.target is checkpoint]
    assert len(calls) == len(plan.segments)
    torch.manual_seed(0)
    got = lowered(x)
    torch.manual_seed(0)
    assert torch.equal(got, gm(x))  # the same draws of its dropout, the same values


def test_a_runner_notes_the_record_it_ran_then_runs_its_graph() -> None:
    ran = []
    record = GraphRecord(index=0, gm=torch.fx.symbolic_trace(torch.nn.ReLU()),
                         plan=SimpleNamespace(summary=lambda: "no segments"), held_bytes=2048,
                         ended_by=("a print",))
    runner = GraphRunner(record, ran.append)
    assert torch.equal(runner(torch.tensor([-1.0, 1.0])), torch.tensor([0.0, 1.0]))
    assert ran == [record] and runner.record_for(()) is record
    assert repr(record) == ("<Dynamo graph 0: no segments; keeps 2.0 KiB for backward, ended "
                            "by: a print>")

"""serve/dynamo/sized.py: which integer inputs of a dynamic Dynamo graph are its tensors' sizes,
and the planner's bookkeeping of what each plan keeps at the sizes it was checked at."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxckpt.serve.dynamo.sized import GraphPlanner, size_inputs


def _dynamic_graph() -> torch.fx.GraphModule:
    """Placeholders as Dynamo hands over a dynamic graph: ``x`` of ``(s0, 3)``, the size ``s0``,
    a counter ``k``, ``y`` of ``(2, s1)`` and ``s1``."""
    env = ShapeEnv()
    s0, s1 = env.create_unbacked_symint(), env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        x, y = torch.empty(s0, 3), torch.empty(2, s1)
    graph = torch.fx.Graph()
    for name, value in (("x", x), ("s0", s0), ("k", 7), ("y", y), ("s1", s1)):
        graph.placeholder(name).meta["example_value"] = value
    graph.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_each_size_input_is_a_tensor_inputs_dimension() -> None:
    assert size_inputs(_dynamic_graph()) == {1: (0, 0), 4: (1, 1)}  # the counter is no size


def test_a_static_graph_has_no_size_inputs() -> None:
    assert size_inputs(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))) == {}


def _planner() -> GraphPlanner:
    driver = SimpleNamespace(leftover=lambda plan: 1000 - plan, counts=None, device="cpu")
    return GraphPlanner(driver, _dynamic_graph(), ("a graph break",))


def test_placeholders_set_each_size_input_to_its_padded_dimension() -> None:
    planner = _planner()
    x, y = torch.ones(5, 3), torch.ones(2, 6)
    args, kwargs = planner.padded((x, 5, 7, y, 6), {}, ((5, 3), (2, 6)), {(0, 0), (1, 1)})
    assert [a.shape if isinstance(a, torch.Tensor) else a for a in args] == [
        (8, 3), 8, 7, (2, 8), 8]
    assert kwargs == {}
    assert planner.padded((x, 5, 7, y, 6), {}, ((5, 3), (2, 6)), set()) is None


def test_what_a_plan_keeps_is_its_own_unless_checked_at_other_sizes() -> None:
    planner = _planner()
    record = SimpleNamespace(index=0, held_bytes=100, plan=300)
    assert planner.held_for(record, None) == 100
    assert planner.held_for(record, ((8, 3),)) == 100
    planner.held[0, ((8, 3),)] = 160
    assert planner.held_for(record, ((8, 3),)) == 160
    assert planner.limit(record) == 700  # the driver's leftover for the plan
    assert planner.shapes((torch.ones(5, 3), 5), {}) == ((5, 3),)
    assert planner.accepts(((1,),)) and planner.ended_by == ("a graph break",)

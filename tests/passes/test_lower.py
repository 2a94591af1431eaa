"""lower: hand-made plans become segment submodules called through the runtime checkpoint.

Checked here without a strategy: the rewritten graph's nodes, each segment's placeholders and
outputs, state shared with the model, the values and gradients of a training step (bit-identical
to the eager model), that segments really run again in backward, and the errors lower raises.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
from handmade import Tiny, plan, segment, traced
from support import assert_steps_equal, run_step

from fxckpt.errors import PlanError
from fxckpt.passes.lower import lower
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.offload import Offloader, offload_region
from fxckpt.runtime.segment import SegmentModule, segment_of

X = (3, 4)

# Three segments covering every compute node but the head; the third reads two earlier outputs.
FC1 = segment("segment_0", ("fc1", "relu"), ("x",), ("relu",))
FC2 = segment("segment_1", ("fc2", "tanh", "mul"), ("relu",), ("mul",))
DROP = segment("segment_2", ("add", "drop"), ("mul", "relu"), ("drop",))
# One segment with two outputs (relu is read by fc2 inside and by add outside).
WIDE = segment("segment_0", ("fc1", "relu", "fc2", "tanh", "mul"), ("x",), ("relu", "mul"))


def lowered(*segments, model: nn.Module | None = None, **kw) -> torch.fx.GraphModule:
    model = model if model is not None else Tiny()
    return lower(traced(model, torch.randn(*X)), plan(*segments, **kw))


def shape(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """(op, target) of every node: the graph's structure without generated names."""
    return [(n.op, n.target) for n in gm.graph.nodes]


def test_segments_become_checkpoint_calls_in_the_parent_graph() -> None:
    gm = lowered(FC1, FC2, DROP)
    assert shape(gm) == [
        ("placeholder", "x"),
        ("get_attr", "segment_0"), ("call_function", checkpoint),
        ("get_attr", "segment_1"), ("call_function", checkpoint),
        ("get_attr", "segment_2"), ("call_function", checkpoint),
        ("call_module", "head"), ("output", "output"),
    ]
    calls = [n for n in gm.graph.nodes if n.target is checkpoint]
    # Each call passes the segment, then its inputs in the plan's order (as the earlier calls).
    assert [a.name for a in calls[0].args[:1]] == ["segment_0"]
    assert calls[0].args[1].name == "x"
    assert calls[1].args[1] is calls[0]
    assert calls[2].args[1:] == (calls[1], calls[0])
    head = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert head.args == (calls[2],)
    # The buffer is read inside segment_1 only: the parent's unused get_attr is gone.
    assert "scale" not in {n.target for n in gm.graph.nodes if n.op == "get_attr"}


def test_segment_graphs_take_the_inputs_and_return_the_outputs() -> None:
    gm = lowered(FC1, FC2, DROP)
    expected = {  # segment: (compute nodes, number of placeholders, returned node names)
        "segment_0": (["fc1", "relu"], 1, ["relu"]),
        "segment_1": (["fc2", "tanh", "mul"], 1, ["mul"]),
        "segment_2": (["add", "drop"], 2, ["drop"]),
    }
    for name, (nodes, n_inputs, outputs) in expected.items():
        sub = gm.get_submodule(name)
        assert isinstance(sub, torch.fx.GraphModule)
        graph = list(sub.graph.nodes)
        assert [n.op for n in graph[:n_inputs]] == ["placeholder"] * n_inputs
        assert not any(n.op == "placeholder" for n in graph[n_inputs:])
        compute = [n.name for n in graph if n.op in ("call_function", "call_module")]
        assert compute == nodes
        out = graph[-1].args[0]
        assert [o.name for o in (out if isinstance(out, tuple) else (out,))] == outputs
    assert [n.target for n in gm.segment_1.graph.nodes if n.op == "get_attr"] == ["scale"]


def test_segments_share_the_models_parameters_and_buffers() -> None:
    model = Tiny()
    gm = lowered(FC1, FC2, model=model)
    assert gm.segment_0.fc1 is model.fc1
    assert gm.segment_1.fc2.weight is model.fc2.weight
    assert gm.segment_1.get_buffer("scale") is model.scale
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()


def test_segment_attributes_the_runtime_reads() -> None:
    restoring = segment("segment_0", ("fc1", "relu"), ("x",), ("relu",), restores=("scale",))
    gm = lowered(restoring, training=False)
    sub = gm.segment_0
    assert isinstance(sub, SegmentModule) and sub.offloader is None
    assert (sub.name, sub.restores) == ("segment_0", ("scale",))
    assert sub.training is False
    assert gm.fc1.training is True  # the model's own modules keep their mode


def test_two_outputs_are_unpacked_with_getitem() -> None:
    gm = lowered(WIDE)
    call = next(n for n in gm.graph.nodes if n.target is checkpoint)
    items = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert [(n.args[0], n.args[1]) for n in items] == [(call, 0), (call, 1)]
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    assert add.args == (items[1], items[0])  # mul + relu, as in the original forward


@pytest.mark.parametrize("segments", [(FC1, FC2, DROP), (WIDE,), (FC2,), ()],
                         ids=["three", "two-outputs", "middle", "none"])
def test_training_step_is_bit_identical_to_eager(segments: tuple) -> None:
    """Outputs, input and parameter gradients, buffers (dropout draws the same mask twice)."""
    model = Tiny()
    reference = copy.deepcopy(model)
    gm = lowered(*segments, model=model)
    x = torch.randn(*X, requires_grad=True)
    assert_steps_equal(run_step(gm, (x,), {}), run_step(reference, (x,), {}))


def test_lowered_graph_in_eval_matches_eager() -> None:
    model = Tiny().eval()
    gm = lowered(FC1, FC2, DROP, model=model, training=False).eval()
    x = torch.randn(*X)
    assert torch.equal(gm(x), model(x))


def _calls(module: nn.Module) -> list[int]:
    count = [0]
    module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def test_segments_run_again_in_backward_only_when_training_with_grad() -> None:
    gm = lowered(FC1, FC2)
    first, second = _calls(gm.segment_0), _calls(gm.segment_1)
    out = gm(torch.randn(*X, requires_grad=True))
    assert (first[0], second[0]) == (1, 1)
    out.sum().backward()
    assert (first[0], second[0]) == (2, 2)  # recomputed once each
    with torch.no_grad():
        gm(torch.randn(*X))
    assert (first[0], second[0]) == (3, 3)  # plain call, nothing to recompute


def test_checkpointed_segment_keeps_fewer_tensors_for_backward() -> None:
    def saved(module: nn.Module) -> int:
        count = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(torch.randn(*X, requires_grad=True))
        return count[0]

    model = Tiny()
    eager, ckpt = saved(model), saved(lowered(FC1, FC2, DROP, model=model))
    assert ckpt < eager, (ckpt, eager)


def test_offload_action_calls_the_offload_region() -> None:
    off = segment("segment_0", ("fc1", "relu"), ("x",), ("relu",), action="offload")
    gm = lowered(off, FC2)
    runners = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert runners == [offload_region, checkpoint, operator.add]


def test_the_offloader_is_given_to_the_segments_the_plan_offloads_only() -> None:
    off = segment("segment_0", ("fc1", "relu"), ("x",), ("relu",), action="offload")
    offloader = Offloader("cpu", threshold=0)
    gm = lower(traced(Tiny(), torch.randn(*X)), plan(off, FC2), offloader)
    assert segment_of(gm, "segment_0").offloader is offloader
    assert segment_of(gm, "segment_1").offloader is None  # recomputed, not offloaded
    assert segment_of(lowered(off, FC2), "segment_0").offloader is None  # none given


def test_verification_runs_offloaded_segments_with_what_offload_leaves_on_the_device() -> None:
    """On fake tensors a copy to the host moves nothing: under offload_simulated the offloader
    packs nothing, and what it would move is off the device until backward unpacks it, so the
    verified peak is the plan's with offload: under the same plan's without it."""
    from fxckpt.measure.verify import fake_step_peak

    off = segment("segment_0", WIDE.nodes, WIDE.inputs, WIDE.outputs, action="offload")
    offloader = Offloader("cpu", threshold=0)
    moved = lower(traced(Tiny(), torch.randn(*X)), plan(off), offloader)
    kept = lower(traced(Tiny(), torch.randn(*X)), plan(off))  # no offloader: nothing moves
    x = torch.randn(64, 4, requires_grad=True)

    def peak(gm: torch.fx.GraphModule) -> int:
        return fake_step_peak(gm, lambda a, k: gm(*a), (x,), {})

    assert peak(moved) < peak(kept)
    assert offloader.stats.packed == 0  # the real hooks never ran
    with torch.no_grad():  # the simulation changes no value: same step as the real offload
        for a, b in zip(moved.parameters(), kept.parameters()):
            b.copy_(a)
    for gm in (moved, kept):
        torch.manual_seed(0)  # the same dropout mask
        gm(x).sum().backward()
    assert offloader.stats.packed > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(moved.parameters(), kept.parameters()))


def test_placeholders_move_before_every_other_node() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    r = graph.call_function(torch.relu, (x,))
    y = graph.placeholder("y")
    graph.output(graph.call_function(torch.add, (r, y)))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    lower(gm, plan(segment("segment_0", ("add",), ("relu", "y"), ("add",))))
    assert [n.op for n in gm.graph.nodes][:2] == ["placeholder", "placeholder"]
    assert [n.name for n in gm.graph.nodes][:2] == ["x", "y"]
    a, b = torch.randn(3), torch.randn(3)
    assert torch.equal(gm(a, b), torch.relu(a) + b)


def test_unknown_node_is_a_plan_error() -> None:
    bad = segment("segment_0", ("fc1", "nonexistent"), ("x",), ("fc1",))
    with pytest.raises(PlanError, match="segment_0 names node 'nonexistent'"):
        lowered(bad)


def test_a_rewrite_that_breaks_the_graph_is_a_plan_error() -> None:
    # relu is read outside the segment but not declared an output: erasing it must fail.
    bad = segment("segment_0", ("fc1", "relu"), ("x",), ("fc1",))
    with pytest.raises(PlanError, match=r"could not rewrite segment_0 \(fc1\.\.relu\)"):
        lowered(bad)


def test_one_output_call_keeps_the_outputs_name() -> None:
    gm = lowered(FC1)
    assert "relu = fxckpt_checkpoint(segment_0, x)" in gm.code

"""Segments: the typed fields the checkpoint and offload runtimes read (name, restores,
offloader)."""

from __future__ import annotations

import copy

import torch
import torch.fx
import torch.nn as nn

import fxckpt
from fxckpt.module import dispatcher_of
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.offload import Offloader
from fxckpt.runtime.segment import Recomputable, SegmentModule, segment_of
from models import MLP
from support import assert_steps_equal, run_step


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _segment() -> tuple[ConvBN, SegmentModule]:
    model = ConvBN()
    traced = torch.fx.symbolic_trace(model)
    return model, SegmentModule(traced, traced.graph, name="segment_7",
                                restores=("bn.running_mean",))


def test_a_segment_is_a_graph_module_with_typed_fields() -> None:
    model, seg = _segment()
    assert isinstance(seg, torch.fx.GraphModule) and isinstance(seg, Recomputable)
    assert type(seg).__name__ == "SegmentModule" and "self.bn" in seg.code
    assert (seg.name, seg.restores, seg.offloader) == ("segment_7", ("bn.running_mean",), None)
    assert seg.restored_buffers()[0] is model.bn.running_mean  # the model's own tensors
    assert seg.conv.weight is model.conv.weight


def test_deepcopy_keeps_the_fields_and_copies_the_tensors() -> None:
    model, seg = _segment()
    seg.offloader = Offloader("cpu", threshold=0)
    other = copy.deepcopy(seg)
    assert isinstance(other, SegmentModule) and other.name == "segment_7"
    assert other.restores == ("bn.running_mean",) and other.offloader is seg.offloader
    assert other.restored_buffers()[0] is not model.bn.running_mean
    assert torch.equal(other.restored_buffers()[0], model.bn.running_mean)


def test_checkpoint_restores_the_buffers_a_segment_names_and_only_those() -> None:
    torch.manual_seed(0)
    model, seg = _segment()
    reference = copy.deepcopy(model)
    seg.train()
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    checkpoint(seg, x).sum().backward()
    reference(x)  # one forward: one update of the statistics
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)  # restored
    # Not named in restores: the recompute updated them a second time.
    assert not torch.equal(model.bn.running_var, reference.bn.running_var)
    assert (model.bn.num_batches_tracked.item(), reference.bn.num_batches_tracked.item()) == (2, 1)


def test_a_plain_module_is_checkpointed_under_its_class_name_restoring_nothing() -> None:
    model = ConvBN().train()
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    checkpoint(model, x).sum().backward()
    assert model.bn.num_batches_tracked.item() == 2


def test_transform_lowers_each_planned_segment_as_a_segment() -> None:
    tm = fxckpt.transform(ConvBN(), every=2, capture="graph")
    tm(torch.randn(2, 3, 5, 5))
    info = fxckpt.inspect(tm)
    for planned in info.plan.segments:
        seg = segment_of(info.graph_module, planned.name)
        assert (seg.name, seg.restores, seg.offloader) == (planned.name, planned.restores, None)
    assert info.plan.segments[0].restores == ("bn.num_batches_tracked", "bn.running_mean",
                                              "bn.running_var")


def test_offloaded_segments_carry_the_modules_offloader() -> None:
    x = torch.randn(16, 64)
    tm = fxckpt.transform(MLP(depth=6, width=64), budget=0.6, offload="auto", offload_device="cpu",
                          offload_threshold=0, offload_bandwidth=1e18, example_inputs=(x,))
    info = fxckpt.inspect(tm)
    actions = {s.name: s.action for s in info.plan.segments}
    assert "offload" in actions.values()
    for name, action in actions.items():
        expected = dispatcher_of(tm).offloader if action == "offload" else None
        assert segment_of(info.graph_module, name).offloader is expected


class FieldNames(nn.Module):
    """Children and a parameter under the names a SegmentModule owns."""

    def __init__(self) -> None:
        super().__init__()
        self.name = nn.Linear(8, 8)
        self.restores = nn.Linear(8, 8)
        self.register_parameter("offloader", nn.Parameter(torch.ones(8)))
        self.restored_buffers = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.name(x)) * self.offloader
        return self.restored_buffers(torch.relu(self.restores(h)))


def test_a_model_with_segment_field_names_keeps_them_and_trains_bit_exact() -> None:
    model = FieldNames()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2, capture="graph")
    assert tm.name is model.name and list(tm.state_dict()) == list(model.state_dict())
    x = torch.randn(4, 8)
    for step in range(2):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    info = fxckpt.inspect(tm)
    seg = segment_of(info.graph_module, "segment_0")
    assert seg.name == "segment_0" and seg.name_fxckpt is model.name  # renamed in the graph
    assert seg.offloader is None and seg.offloader_fxckpt is model.offloader
    assert info.plan.segments[0].module_paths == ("name", "<root>", "restores")  # in run order


def test_early_stop_leaves_a_segment_without_a_traceback_walk(monkeypatch) -> None:
    # checkpoint ends each recompute by raising through the segment; fx's wrapper would walk
    # the traceback (a stat per frame) every time, 16 walks a step for 16 segments: it must not.
    import traceback

    walks = []
    original = traceback.StackSummary._extract_from_extended_frame_gen

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        walks.append(1)
        return original(*args, **kwargs)

    model, x = MLP(depth=16, width=16), torch.randn(4, 16)
    tm = fxckpt.transform(copy.deepcopy(model), every=1, example_inputs=(x,))
    assert len(fxckpt.inspect(tm).plan.segments) >= 8
    assert_steps_equal(run_step(tm, (x,), {}), run_step(model, (x,), {}))
    monkeypatch.setattr(traceback.StackSummary, "_extract_from_extended_frame_gen",
                        classmethod(lambda cls, *a, **k: counted(*a, **k)))
    tm(x).sum().backward()
    assert walks == []


def test_an_error_inside_a_segment_keeps_its_type_and_fxs_message(capsys) -> None:
    traced = torch.fx.symbolic_trace(lambda x: torch.mm(x, x))
    seg = SegmentModule(traced, traced.graph, name="segment_3")
    try:
        seg(torch.randn(2, 3))  # not square: mm fails in the generated code
    except RuntimeError as e:
        assert "cannot be multiplied" in str(e)
    else:
        raise AssertionError("mm of a 2x3 by itself did not fail")
    assert "Call using an FX-traced Module" in capsys.readouterr().err

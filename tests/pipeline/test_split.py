"""The split pass: one GraphModule per stage from a stage assignment, carrying values that skip
stages, around checkpoint calls, and with sizes read off the tensors a stage receives."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxckpt.capture.captured import capture
from fxckpt.cost.annotate import annotate, info
from fxckpt.errors import ConfigError
from fxckpt.pipeline.partition import partition, stage_order
from fxckpt.pipeline.split import split_stages
from models import MLP, UNet
from stage_graphs import annotated_graph as _graph


def _chain(stages: list, *inputs: torch.Tensor):
    value = stages[0](*inputs)
    for s in stages[1:]:
        value = s(*value)
    return value


def test_stages_carry_values_that_skip_stages() -> None:
    x = torch.randn(2, 1, 8, 8)
    model = UNet()
    gm, _ = _graph(model, x)
    sp = partition(gm, 3)
    stages = split_stages(gm, sp.stage_of)
    assert torch.equal(_chain(stages, x), gm(x))
    nodes = {n.name: n for n in gm.graph.nodes}
    skips = [name for name, s in sp.stage_of.items()
             if s == 0 and any(sp.stage_of.get(u.name) == 2 for u in nodes[name].users)]
    assert skips, "the U-Net should have a skip from stage 0 to stage 2"
    middle = stages[1].meta["fxckpt_stage"]
    for name in skips:
        assert name in middle["inputs"] and name in middle["outputs"]
    shared = {id(p) for s in stages for p in s.parameters()}
    assert shared == {id(p) for p in model.parameters()}  # the same Parameter objects, not copies


def test_lowered_graphs_split_around_checkpoint_calls() -> None:
    x = torch.randn(4, 32)
    torch.manual_seed(0)
    gm, plan = _graph(MLP(depth=6, p=0.0), x, every=2, lowered=True)
    assert plan is not None
    sp = partition(gm, 3, plan=plan)
    assert sum(sp.costs) == plan.total_flops + plan.recompute_flops
    stages = split_stages(gm, sp.stage_of)
    calls = [
        n
        for s in stages
        for n in s.graph.nodes
        if n.op == "get_attr" and n.target.startswith("segment_")
    ]
    assert sorted(c.target for c in calls) == sorted(seg.name for seg in plan.segments)
    torch.testing.assert_close(_chain(stages, x), gm(x), rtol=0, atol=0)


def test_split_rejects_stages_that_are_not_contiguous() -> None:
    gm, _ = _graph(MLP(depth=2), torch.randn(4, 32))
    names = [n.name for n in stage_order(gm)]
    with pytest.raises(ConfigError, match="stages must be contiguous"):
        split_stages(gm, {name: i % 2 for i, name in enumerate(names)})
    with pytest.raises(ConfigError, match="missing"):
        split_stages(gm, {names[0]: 0})


class Flatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return self.fc(h.reshape(b * s, 8)).reshape(b, s, 8)


class Reshaping(nn.Module):
    """Sizes read early and used late; a Python test on a size, so torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 8), Flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        if b > 0:  # symbolic_trace cannot branch on a size: export captures, with dynamic dims
            x = x * 2
        return self.head(self.fc(x), b, s)


def test_sizes_are_read_off_carried_tensors_not_sent() -> None:
    """An exported graph's ``sym_size`` values are not tensors: the next stage reads them off a
    tensor it receives instead, so only tensors cross stage boundaries (as pipelining needs)."""
    model, x = Reshaping(), torch.randn(4, 3, 4)
    captured = capture(model, (x,), {})
    assert captured.method == "export" and captured.shape_free
    annotate(captured.gm, captured.graph_args((x,), {}))
    stages = split_stages(captured.gm, partition(captured.gm, balance=["head"]).stage_of)
    carried = [n for n in stages[1].graph.nodes if n.op == "placeholder"]
    assert carried and all(info(n).is_tensor for n in carried), [n.name for n in carried]
    x = torch.randn(5, 2, 4)  # another batch and sequence length
    (out,) = stages[1](*stages[0](x))  # exported graphs' stages: flat inputs, a flat output
    torch.testing.assert_close(out, model(x))


class CausalBlocks(nn.Module):
    """Two attention blocks sharing a causal mask built from the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[1], device=x.device)
        mask = rows[None, :] <= rows[:, None]
        for block in self.blocks:
            q = block(x).unsqueeze(1)
            x = x + torch.nn.functional.scaled_dot_product_attention(
                q, q, q, attn_mask=mask).squeeze(1)
        return x


def test_a_mask_verdict_from_sizes_is_made_again_in_each_stage_not_sent() -> None:
    """The verdict is a tuple, which torch.distributed.pipelining cannot send: the second stage
    makes its own from the sizes it reads off the tensor it receives."""
    from fxckpt.runtime.attention import sized_mask

    model, x = CausalBlocks(), torch.randn(2, 6, 8)
    captured = capture(model, (x,), {}, method="export")
    assert captured.method == "export"
    annotate(captured.gm, captured.graph_args((x,), {}))
    stages = split_stages(captured.gm, partition(captured.gm, balance=["blocks.0"]).stage_of)
    assert len(stages) == 2
    for stage in stages:
        assert [n for n in stage.graph.nodes if n.target is sized_mask]
    carried = [n for n in stages[1].graph.nodes if n.op == "placeholder"]
    assert carried and all(info(n).is_tensor for n in carried), [n.name for n in carried]
    for x in (torch.randn(2, 6, 8), torch.randn(3, 9, 8)):
        (out,) = stages[1](*stages[0](x))
        torch.testing.assert_close(out, model(x))

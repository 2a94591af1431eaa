"""Hand-made plans over a tiny traced model, so lower and flatten are tested without a strategy.

``Tiny`` traces (symbolic_trace) to::

    x -> fc1 -> relu -> fc2 -> tanh -> mul(., scale) -> add(., relu) -> drop -> head -> out

``scale`` is a buffer read through a ``get_attr`` node; ``relu`` has two readers (``fc2`` and
``add``), so a segment ending at ``mul`` that starts at ``fc1`` has two outputs.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from fxckpt.capture.captured import capture
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.plan import PipelineView, Plan, SegmentSpec, StageView

__all__ = ["Tiny", "segment", "plan", "traced"]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        g = torch.tanh(self.fc2(h)) * self.scale
        return self.head(self.drop(g + h))


def segment(name: str, nodes: tuple[str, ...], inputs: tuple[str, ...],
            outputs: tuple[str, ...], restores: tuple[str, ...] = (),
            action: str = "recompute") -> SegmentSpec:
    """A SegmentSpec with only the fields lower and flatten read filled in meaningfully."""
    return SegmentSpec(name=name, nodes=nodes, module_paths=(), inputs=inputs, outputs=outputs,
                       saved_bytes=0, freed_bytes=0, recompute_flops=0, restores=restores,
                       reason="test", action=action)


def plan(*segments: SegmentSpec, training: bool = True,
         pipeline: PipelineView | None = None) -> Plan:
    return Plan(strategy="force", options={}, capture="symbolic_trace", training=training,
                signature="", segments=segments, node_count=0, total_flops=0,
                pipeline=pipeline)


def traced(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    """A fresh graph module of ``model`` (its own graph, the model's modules and tensors)."""
    return copy_graph_module(capture(model, args, {}).gm)


def pipeline_view(checkpoint: str = "except_last", stop: int = 3) -> PipelineView:
    """Two stages (cpu, cuda:1) of four micro-batches, as a plan shows them."""
    stages = (StageView(stage=0, device="cpu", nodes=3, cost=1234.4, modules=("layers.0",)),
              StageView(stage=1, device="cuda:1", nodes=2, cost=99.0,
                        modules=("layers.1", "head")))
    return PipelineView(stages=stages, chunks=4, checkpoint=checkpoint, stop=stop,
                        method="balanced", stage_of={"fc": 0, "relu": 0, "head": 1})


def mlp_plan(**options: object) -> Plan:
    """The plan ``fxckpt.transform`` makes for a 4-block MLP at batch 4 with ``options``."""
    import fxckpt
    from models import MLP

    tm = fxckpt.transform(MLP(depth=4), **options, example_inputs=(torch.randn(4, 32),))
    return fxckpt.inspect(tm).plan


def annotated(model: nn.Module, *inputs: torch.Tensor, every: int | None = None,
              lowered: bool = False) -> tuple[torch.fx.GraphModule, Plan | None]:
    """``model`` captured and annotated for ``inputs``, with the plan of ``every=`` when asked
    (lowered into the graph when ``lowered``)."""
    from fxckpt.config import TransformConfig
    from fxckpt.cost.annotate import annotate
    from fxckpt.passes.lower import lower
    from fxckpt.planning.select import select

    captured = capture(model, inputs, {})
    annotate(captured.gm, captured.graph_args(inputs, {}))
    if every is None:
        return captured.gm, None
    plan = select(captured.gm, TransformConfig.from_options(every=every),
                  capture=captured.method, training=True, signature="")
    if lowered:
        lower(captured.gm, plan)
    return captured.gm, plan

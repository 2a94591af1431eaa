"""The pass pipeline: capture -> annotate -> select -> lower, for one input signature.

    model --capture--> GraphModule --annotate--> costed graph --select--> Plan
          --lower--> rewritten GraphModule (segments called through fxckpt.checkpoint)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import torch
import torch.fx

from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError
from fxckpt.pipeline_build import build_pipeline
from fxckpt.runtime.microbatch import batch_size, scatter
from fxckpt.runtime.schedule import bubble_fraction
from fxckpt.passes import annotate, capture, lower, select
from fxckpt.passes.capture import Captured
from fxckpt.plan import Plan
from fxckpt.signature import describe_signature

__all__ = ["Compiled", "build"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Compiled:
    """What the transformed module runs for one signature."""

    captured: Captured
    gm: torch.fx.GraphModule
    plan: Plan
    pipeline: Optional[torch.nn.Module] = None
    """The pipelined module (``fxckpt.pipeline_build.PipelinedModule``) when stages were asked for."""

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.captured.call(self.pipeline or self.gm, args, kwargs)  # type: ignore[arg-type]


def build(model: torch.nn.Module, config: TransformConfig, args: tuple, kwargs: dict) -> Compiled:
    """Plan and rewrite ``model`` for calls like ``model(*args, **kwargs)`` in its current mode."""
    start = time.perf_counter()
    plan_args, plan_kwargs = _first_micro_batch(config, args, kwargs)
    captured = capture(model, plan_args, plan_kwargs)
    if config.pipelined and captured.method != "symbolic_trace":
        _check_even_split(config, args, kwargs)
    gm = captured.gm
    annotate(gm, captured.graph_args(plan_args, plan_kwargs))
    plan = select(
        gm, config, capture=captured.method, training=model.training,
        signature=describe_signature(args, kwargs),
    )
    lower(gm, plan)
    pipeline = None
    if config.pipelined:
        pipeline = build_pipeline(
            gm, plan, chunks=config.chunks or 1, devices=list(config.devices or [_device_of(model)]),
            checkpoint=config.checkpoint, stages=config.stages,
            balance=None if config.balance is None else list(config.balance),
        )
        plan = dataclasses.replace(plan, pipeline=_pipeline_view(pipeline, config))
    log.info("planned %s for %s in %.2fs", type(model).__name__, plan.signature, time.perf_counter() - start)
    return Compiled(captured, gm, plan, pipeline)


def _first_micro_batch(config: TransformConfig, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Stages run one micro-batch at a time: plan (and capture, for export) at that shape."""
    if not config.pipelined or not config.chunks:
        return args, kwargs
    return scatter(args, kwargs, config.chunks)[0]


def _check_even_split(config: TransformConfig, args: tuple, kwargs: dict) -> None:
    batch = batch_size(args, kwargs)
    chunks = config.chunks or 1
    if batch and batch >= chunks and batch % chunks:
        raise ConfigError(
            f"a graph captured with torch.export is specialised to one micro-batch shape, so the batch "
            f"({batch}) must split evenly into chunks={chunks}; use a batch that is a multiple of "
            f"{chunks}, or a model symbolic_trace can capture"
        )


def _device_of(model: torch.nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else str(first.device)


def _pipeline_view(pipelined: Any, config: TransformConfig) -> dict[str, Any]:
    stage_plan = pipelined.stage_plan
    devices = [str(d) for d in pipelined.pipeline.devices]
    chunks = config.chunks or 1
    return {
        "chunks": chunks, "checkpoint": config.checkpoint, "method": stage_plan.method,
        "stages": [
            {"stage": i, "device": devices[i], "nodes": len(nodes), "cost": cost, "modules": list(mods)}
            for i, (nodes, cost, mods) in enumerate(zip(stage_plan.nodes, stage_plan.costs, stage_plan.module_paths))
        ],
        "stage_of": dict(stage_plan.stage_of),
        "bubble": bubble_fraction(chunks, len(devices)),
        "schedule": pipelined.schedule_chart(),
    }

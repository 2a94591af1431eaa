"""Pipelines across processes: fxckpt stages as ``torch.distributed.pipelining`` stages.

When one host is not enough, the same stage GraphModules that :func:`fxckpt.pipeline_build.
build_pipeline` runs locally become one ``PipelineStage`` per rank, and torch's schedules drive
them (point-to-point sends between ranks instead of ``.to(device)``):

    rank 0: PipelineStage(stage 0) --send activations--> rank 1: PipelineStage(stage 1) --> loss_fn
            <------------------------ send gradients ------------------------

    GPipe   F0 F1 F2 F3 . . . B3 B2 B1 B0        all forwards, then all backwards
    1F1B    F0 F1 B0 F2 B1 F3 B2 B3              at most K micro-batches in flight per stage

A stage keeps its checkpoint plan: segments lowered into it still run through
``fxckpt.checkpoint``; ``recompute=True`` additionally checkpoints the whole stage per
micro-batch (``checkpoint="always"`` of the local pipeline). Values sent between ranks must be
tensors (``torch.distributed.pipelining`` sends nothing else); :func:`build_stage` checks that
and names any value that is not. BatchNorm statistics are updated per micro-batch here (no
deferral across ranks).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx
import torch.nn as nn

from fxckpt.errors import ConfigError
from fxckpt.runtime.checkpoint import checkpoint as run_checkpointed
from fxckpt.runtime.pipeline import check_device

__all__ = ["build_stage", "schedule", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


class _Recomputed(nn.Module):
    """The stage run under checkpoint for every micro-batch."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._fxckpt_name = "distributed stage"
        self._fxckpt_restores = tuple(name for name, _ in self.named_buffers())

    def forward(self, *args: Any) -> Any:
        return run_checkpointed(self.module, *args)


def _stage_modules(stages: Any) -> list[nn.Module]:
    if hasattr(stages, "stage_modules"):
        return list(stages.stage_modules)
    if isinstance(stages, (list, tuple)) and stages and all(isinstance(s, nn.Module) for s in stages):
        return list(stages)
    raise ConfigError(f"stages must be a list of stage modules or a pipelined module (got {type(stages).__name__})")


def _check_tensor_edges(module: nn.Module, index: int, count: int) -> None:
    """Values crossing ranks must be tensors; the stage's annotations say which are not."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    nodes = list(module.graph.nodes)
    edges = [n for n in nodes if n.op == "placeholder"] if index > 0 else []
    if index < count - 1:
        out = next(n for n in reversed(nodes) if n.op == "output")
        edges += [a for a in out.all_input_nodes]
    bad = [n.name for n in edges if "fxckpt" in n.meta and not n.meta["fxckpt"].is_tensor]
    if bad:
        raise ConfigError(
            f"stage {index} sends or receives non-tensor values {bad} between ranks, which "
            "torch.distributed.pipelining cannot carry; choose other stage boundaries (balance=)"
        )


def build_stage(
    stages: Union[Sequence[nn.Module], Any],
    stage_index: int,
    device: Union[str, torch.device],
    *,
    group: Optional[Any] = None,
    recompute: bool = False,
) -> Any:
    """The ``PipelineStage`` of ``stages[stage_index]`` on ``device`` for this rank.

    ``stages`` is the list from :func:`fxckpt.passes.partition.split_stages` or a module from
    :func:`fxckpt.pipeline_build.build_pipeline`. Every rank builds the same stages and keeps one.
    """
    from torch.distributed.pipelining import PipelineStage

    modules = _stage_modules(stages)
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < len(modules):
        raise ConfigError(f"stage_index must be an integer in [0, {len(modules) - 1}] (got {stage_index!r})")
    dev = check_device(device)
    module = modules[stage_index]
    _check_tensor_edges(module, stage_index, len(modules))
    module = module.to(dev)
    if recompute:
        module = _Recomputed(module)
    return PipelineStage(module, stage_index, len(modules), dev, group=group)


def schedule(stage: Any, kind: str, n_microbatches: int, loss_fn: Optional[Callable] = None,
             *, scale_grads: bool = True) -> Any:
    """A ``ScheduleGPipe`` (``"gpipe"``) or ``Schedule1F1B`` (``"1f1b"``) running ``stage``.

    ``loss_fn(output, target)`` is applied per micro-batch on the last rank. With
    ``scale_grads=True`` (torch's default) gradients are divided by ``n_microbatches``; pass
    ``False`` with a loss summed over the batch to get the full batch's gradient.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    if kind not in SCHEDULES:
        raise ConfigError(f"schedule kind must be one of {SCHEDULES} (got {kind!r})")
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ConfigError(f"n_microbatches must be a positive integer (got {n_microbatches!r})")
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)

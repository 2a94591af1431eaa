"""Build a pipelined module from an annotated (and possibly lowered) GraphModule.

    gm --partition--> StagePlan --split_stages--> stage GraphModules --Pipeline--> module
                      (DP over costs, or balance=)   (skips carried)       (micro-batches, devices)

This is the one place that joins the passes (:mod:`fxckpt.pipeline.partition`) and the runtime
(:mod:`fxckpt.runtime.pipeline`), and the place where every pipeline argument is checked, so a
bad value fails when the module is built, with the rule and the value in the message.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
import torch.nn as nn
import torch.utils._pytree as pytree

from fxckpt.errors import ConfigError
from fxckpt.pipeline.batch_outputs import batch_outputs
from fxckpt.pipeline.partition import Balance, StagePlan, partition, stage_order
from fxckpt.pipeline.split import pytree_specs, split_stages
from fxckpt.plan import PipelineView, Plan, StageView
from fxckpt.runtime.pipeline import (Device, Pipeline, check_checkpoint, check_chunks,
                                     check_devices, one_device_per_stage)

__all__ = ["PipelinedModule", "build_pipeline"]

log = logging.getLogger(__name__)


class PipelinedModule(nn.Module):
    """A graph run as a GPipe pipeline; called like the GraphModule it was built from."""

    def __init__(
        self, pipeline: Pipeline, stage_plan: StagePlan, gm: torch.fx.GraphModule
    ) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.stage_plan = stage_plan
        self._specs = pytree_specs(gm)
        self._signature = inspect.signature(gm.forward)
        tree_info = getattr(gm.graph._codegen, "pytree_info", None)
        self._orig_args: list[str] = list(tree_info.orig_args) if tree_info is not None else []

    @property
    def stage_modules(self) -> list[nn.Module]:
        """The stage GraphModules, in order (what ``fxckpt.distributed.build_stage`` takes)."""
        return [s.get_submodule("module") for s in self.pipeline.stages]

    @property
    def chunks(self) -> int:
        """Micro-batches per call (fewer when the batch is smaller)."""
        return self.pipeline.chunks

    @property
    def recomputed(self) -> list[tuple[int, int]]:
        """``(micro-batch, stage)`` pairs recomputed in the latest backward."""
        return self.pipeline.recomputed

    def schedule_chart(self, micro_batches: Optional[int] = None) -> str:
        return self.pipeline.schedule_chart(micro_batches)

    def view(self) -> PipelineView:
        """The stages and schedule as the plan keeps them (checkpointing as the mode has it)."""
        sp, runner = self.stage_plan, self.pipeline
        stages = tuple(
            StageView(stage=j, device=str(device), nodes=count, cost=cost, modules=tuple(mods))
            for j, (device, count, cost, mods)
            in enumerate(zip(runner.devices, sp.planned, sp.costs, sp.module_paths)))
        return PipelineView(stages=stages, chunks=runner.chunks, checkpoint=runner.checkpoint,
                            stop=runner.checkpoint_stop(runner.chunks), method=sp.method,
                            stage_of=dict(sp.stage_of), cost=sp.cost)

    def describe(self) -> str:
        """The stage table (with devices) and the schedule chart, as ``str(plan)`` shows them."""
        return str(self.view())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._specs is None:
            return self.pipeline(*args, **kwargs)
        in_spec, out_spec = self._specs
        out = self.pipeline(*fx_pytree.tree_flatten_spec(self._as_spec(args, kwargs), in_spec))
        return pytree.tree_unflatten(
            list(out) if isinstance(out, (tuple, list)) else [out], out_spec
        )

    def _as_spec(self, args: tuple, kwargs: dict) -> Any:
        """The call's inputs shaped like the exported graph's ``in_spec`` (as its own forward
        does)."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [bound.arguments[name.split(":")[0].strip()] for name in self._orig_args]
        in_spec = self._specs[0] if self._specs else None
        if in_spec is not None and in_spec.type is tuple and in_spec.num_children == 2 \
                and in_spec.child(1).type is dict:
            count = in_spec.child(0).num_children
            return tuple(values[:count]), dict(zip(in_spec.child(1).context, values[count:]))
        return values


def build_pipeline(
    gm: torch.fx.GraphModule,
    plan: Optional[Plan] = None,
    *,
    chunks: int,
    devices: Sequence[Device],
    checkpoint: str = "except_last",
    stages: Optional[int] = None,
    balance: Optional[Balance] = None,
    cost: str = "flops",
) -> PipelinedModule:
    """Cut the annotated ``gm`` into stages and run them as a pipeline.

    Args:
        gm: an annotated GraphModule (``fxckpt.cost.annotate``), lowered or not.
        plan: the checkpoint Plan of ``gm``; its segments cost twice and are never cut.
        chunks: micro-batches per call (fewer when the batch is smaller).
        devices: one device per stage, or a single device for all ``stages``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (per micro-batch recompute).
        stages: the number of stages; default ``len(devices)``.
        balance: node counts per stage, or the module paths where stages 1..K-1 begin.
        cost: balance by ``"flops"`` (forward plus recompute) or ``"memory"`` (bytes allocated).
    """
    check_chunks(chunks)
    check_checkpoint(checkpoint)
    _refuse_batch_outputs(gm, chunks)
    devs = check_devices(devices)
    k = _stage_count(stages, devs, balance)
    if len(devs) == 1 and k > 1:
        devs = devs * k
    n = len(stage_order(gm))
    if balance is None and k > n:
        raise ConfigError(
            f"stages must be at most the graph's {n} compute node(s) (got {k} stages)"
        )
    stage_plan = partition(gm, k, balance=balance, plan=plan, cost=cost)
    if len(devs) != stage_plan.stages:
        raise one_device_per_stage(stage_plan.stages, devs, "balance makes ")
    modules = split_stages(gm, stage_plan.stage_of)
    names = [p.name for p in gm.graph.nodes if p.op == "placeholder"]
    pipe = Pipeline(modules, devs, chunks, checkpoint, input_names=names)
    for m in (pipe, *pipe.stages):  # the graph's mode, without touching the model's own modules
        m.training = gm.training
    log.info("fxckpt pipeline: %d stage(s) on %s, chunks=%d, checkpoint=%s", stage_plan.stages,
             [str(d) for d in devs], chunks, checkpoint)
    return PipelinedModule(pipe, stage_plan, gm)


def _refuse_batch_outputs(gm: torch.fx.GraphModule, chunks: int) -> None:
    found = batch_outputs(gm) if chunks > 1 else []
    if found:
        raise ConfigError(
            f"{', '.join(found)} is not a tensor and changes with the batch size (e.g. "
            f"x.shape[0]); with chunks={chunks} the model runs on micro-batches, whose value is "
            "not the batch's. Return it as a tensor with a batch dimension, compute it outside "
            "the model, or use chunks=1"
        )


def _stage_count(
    stages: object, devices: list[torch.device], balance: Union[Balance, None]
) -> int:
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ConfigError(f"stages must be a positive integer (got {stages!r})")
        if len(devices) not in (1, stages):
            raise ConfigError(
                f"stages={stages} needs {stages} devices or a single one (got {len(devices)}: "
                f"{[str(d) for d in devices]})"
            )
        return stages
    if balance is not None and len(devices) == 1 and isinstance(balance, (list, tuple)):
        strings = all(isinstance(b, str) for b in balance)
        return len(balance) + 1 if strings and balance else len(balance)
    return len(devices)

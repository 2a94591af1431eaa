"""The pass pipeline: capture -> annotate -> select -> lower, for one input signature.

    model --capture--> GraphModule --annotate--> costed graph --select--> Plan
          --lower--> rewritten GraphModule (segments called through fxckpt.checkpoint)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.fx

from fxckpt.config import TransformConfig
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

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.captured.call(self.gm, args, kwargs)


def build(model: torch.nn.Module, config: TransformConfig, args: tuple, kwargs: dict) -> Compiled:
    """Plan and rewrite ``model`` for calls like ``model(*args, **kwargs)`` in its current mode."""
    start = time.perf_counter()
    captured = capture(model, args, kwargs)
    gm = captured.gm
    annotate(gm, captured.graph_args(args, kwargs))
    plan = select(
        gm, config, capture=captured.method, training=model.training,
        signature=describe_signature(args, kwargs),
    )
    lower(gm, plan)
    log.info("planned %s for %s in %.2fs", type(model).__name__, plan.signature, time.perf_counter() - start)
    return Compiled(captured, gm, plan)

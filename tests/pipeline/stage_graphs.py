"""The annotated graph of a model that the pipeline tests cut into stages (test_partition.py,
test_split.py), with the plan of ``every=`` when asked, lowered when asked."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fxckpt.capture.captured import capture
from fxckpt.config import TransformConfig
from fxckpt.cost.annotate import annotate
from fxckpt.passes.lower import lower
from fxckpt.planning.select import select


def annotated_graph(model: nn.Module, x: torch.Tensor, every: Optional[int] = None,
                    lowered: bool = False):
    captured = capture(model, (x,), {})
    annotate(captured.gm, [x])
    plan = None
    if every is not None:
        plan = select(
            captured.gm,
            TransformConfig.from_options(every=every),
            capture=captured.method,
            training=True,
            signature="",
        )
        if lowered:
            lower(captured.gm, plan)
    return captured.gm, plan


"""The annotated graph of a model that the pipeline tests cut into stages (test_partition.py,
test_split.py), with the plan of ``every=`` when asked, lowered when asked."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fxckpt.plan import Plan
from handmade import annotated


def annotated_graph(model: nn.Module, x: torch.Tensor, every: Optional[int] = None,
                    lowered: bool = False) -> tuple[torch.fx.GraphModule, Optional[Plan]]:
    return annotated(model, x, every=every, lowered=lowered)

"""``fxckpt.transform``: the one call users make."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError
from fxckpt.module import TransformedModule

__all__ = ["transform"]


def transform(
    model: torch.nn.Module,
    *,
    every: Optional[int] = None,
    depth: Optional[int] = None,
    force: Optional[Mapping[str, str]] = None,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[Mapping[str, Any]] = None,
) -> TransformedModule:
    """Return ``model`` rewritten to recompute activations in backward instead of keeping them.

    Args:
        model: the ``nn.Module`` to transform. The result shares its parameters and buffers.
        every: checkpoint segments of ``every`` units of work (matmul / convolution nodes).
        depth: make each module at this nesting depth a segment (``layers.3`` has depth 2).
        force: ``{"module.path": "recompute" | "save"}`` pins parts of the model either way;
            applies on top of the strategy, or alone.
        example_inputs: positional inputs to plan with now; without them fxckpt plans at the
            first call, once per input signature (shapes, dtypes, devices, non-tensor values).
        example_kwargs: keyword inputs to plan with now.

    With no strategy nothing is checkpointed, and the plan says so.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module (got {type(model).__name__}); wrap a function in an "
            "nn.Module whose forward calls it"
        )
    config = TransformConfig(every=every, depth=depth, force=force or {}).validate(model)
    from fxckpt.planner import build  # the passes load only when a transform is made

    tm = TransformedModule(model, config, build)
    if example_inputs is not None or example_kwargs is not None:
        if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
            raise ConfigError(
                f"example_inputs must be a tuple of positional inputs (got {type(example_inputs).__name__}); "
                "write example_inputs=(x,)"
            )
        tm.plan_for(*(example_inputs or ()), **dict(example_kwargs or {}))
    return tm

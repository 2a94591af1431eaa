"""fxckpt: activation checkpointing and pipelines for PyTorch models, chosen by compiler passes.

    tm = fxckpt.transform(model, every=2)     # or depth=2, force={...}
    loss = loss_fn(tm(x), y); loss.backward() # same gradients, less memory
    info = fxckpt.inspect(tm); print(info.plan); print(info.code)

``fxckpt.distributed`` (stages for ``torch.distributed.pipelining``, in
``fxckpt/pipeline/distributed.py``) is imported on first use.
"""

from typing import Any

from fxckpt.api import pareto, transform
from fxckpt.config import TransformConfig
from fxckpt.export import load, save
from fxckpt import errors
from fxckpt.errors import *  # noqa: F403  every error of errors.__all__, fxckpt.CaptureError
from fxckpt.viz.inspection import Inspection, inspect
from fxckpt.module import TransformedModule
from fxckpt.plan import PipelineView, Plan, SegmentSpec, StageView
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.viz import plot_memory, plot_pareto, plot_schedule, show

__version__ = "0.1.0"

__all__ = [
    "transform",
    "inspect",
    "Inspection",
    "pareto",
    "show",
    "plot_memory",
    "plot_pareto",
    "plot_schedule",
    "save",
    "load",
    "checkpoint",
    "TransformConfig",
    "TransformedModule",
    "Plan",
    "SegmentSpec",
    "PipelineView",
    "StageView",
    "distributed",
]
__all__ += errors.__all__


def __getattr__(name: str) -> Any:
    # `fxckpt.distributed` without importing it (and torch.distributed) with every `import fxckpt`.
    if name == "distributed":
        import importlib

        return importlib.import_module("fxckpt.pipeline.distributed")
    if name == "Segment":  # a deprecated alias of SegmentSpec, the plan's segment type
        import warnings

        warnings.warn("fxckpt.Segment is now fxckpt.SegmentSpec (a plan's segment; the runtime's "
                      "module is fxckpt.runtime.segment.SegmentModule)", DeprecationWarning,
                      stacklevel=2)
        return SegmentSpec
    raise AttributeError(f"module 'fxckpt' has no attribute {name!r}")

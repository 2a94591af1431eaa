"""Pictures of plans, returned as matplotlib figures (``pip install fxckpt[viz]``).

    fxckpt.show(tm)                                 # graph: segments coloured, stages outlined
    fxckpt.plot_memory(tm, inputs=(x,))             # predicted (and measured) memory over a step
    fxckpt.plot_pareto(model, example_inputs=(x,))  # memory vs recompute, one point per budget
    fxckpt.viz.plot_schedule(tm)                    # pipeline schedule as a Gantt chart

Each takes ``path=`` to save the picture too. Importing this package does not import matplotlib;
drawing does, with an install hint when it is missing. Nor does it import the pictures' modules
until one is asked for: :mod:`fxckpt.viz.text`, which :mod:`fxckpt.plan` prints with, must load
without the modules that read plans.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["show", "plot_memory", "plot_pareto", "plot_schedule"]

_HOMES = {"show": "graph", "plot_memory": "memory", "plot_pareto": "charts",
          "plot_schedule": "charts"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"fxckpt.viz.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fxckpt.viz' has no attribute {name!r}")

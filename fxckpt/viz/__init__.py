"""Pictures of plans, returned as matplotlib figures (``pip install fxckpt[viz]``).

    fxckpt.show(tm)                                 # graph: segments coloured, stages outlined
    fxckpt.plot_memory(tm, inputs=(x,))             # predicted (and measured) memory over a step
    fxckpt.plot_pareto(model, example_inputs=(x,))  # memory vs recompute, one point per budget
    fxckpt.viz.plot_schedule(tm)                    # pipeline schedule as a Gantt chart

Each takes ``path=`` to save the picture too. Importing this package does not import matplotlib;
drawing does, with an install hint when it is missing.
"""

from fxckpt.viz.charts import plot_pareto, plot_schedule
from fxckpt.viz.graph import show
from fxckpt.viz.memory import plot_memory

__all__ = ["show", "plot_memory", "plot_pareto", "plot_schedule"]

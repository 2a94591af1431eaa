"""What every picture needs: matplotlib (optional), the inspected graph, colours, saving.

Plotting is an optional extra (``pip install fxckpt[viz]``), so matplotlib is imported only
inside the functions that draw, and a missing install says how to fix it. Pictures are built on
``matplotlib.figure.Figure`` directly, not through pyplot, so drawing many of them in a script
keeps no global state and works without a display; a notebook shows the returned figure.

Every picture is drawn from the same three things, whatever the module is:

* the :class:`~fxckpt.plan.Plan`;
* the networkx view of the graph the plan was made on, with each op's ``segment`` and
  ``stage`` added (for a transformed module: its lowered graph flattened again; for a loaded
  one: the view saved in the export).
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, Optional, Union

import networkx as nx

from fxckpt.plan import Plan

__all__ = [
    "require_matplotlib",
    "new_figure",
    "finish",
    "Inspected",
    "inspect_module",
    "segment_colors",
    "stage_colors",
    "KEPT_COLOR",
]

KEPT_COLOR = "#c8c8c8"
PathLike = Union[str, os.PathLike]


def require_matplotlib() -> Any:
    """The ``matplotlib.figure`` module, or an ImportError with the install command."""
    try:
        import matplotlib.figure
    except ImportError as e:
        raise ImportError("fxckpt's pictures need matplotlib: pip install 'fxckpt[viz]' "
                          "(or pip install matplotlib)") from e
    return matplotlib.figure


def new_figure(width: float, height: float) -> Any:
    figure = require_matplotlib()
    _show_in_notebooks(figure.Figure)
    return figure.Figure(figsize=(width, height), layout="constrained")


def _show_in_notebooks(figure_class: type) -> None:
    """In IPython, display a returned Figure as a PNG even without ``%matplotlib inline``."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "display_formatter"):
        return
    png = shell.display_formatter.formatters["image/png"]
    if figure_class not in png.type_printers:
        png.for_type(figure_class, _png_bytes)


def _png_bytes(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def finish(fig: Any, path: Optional[PathLike]) -> Any:
    """Save ``fig`` to ``path`` (format from the suffix) when given; return it."""
    if path is not None:
        fig.savefig(os.fspath(path), dpi=120)
    return fig


class Inspected:
    """The plan and annotated graph view of a transformed or loaded module."""

    def __init__(self, plan: Plan, view: nx.DiGraph) -> None:
        self.plan = plan
        self.view = view

    def ops(self) -> list[str]:
        """Op nodes in graph order."""
        ops = [n for n, d in self.view.nodes(data=True) if d.get("kind") == "op"]
        return sorted(ops, key=lambda n: self.view.nodes[n]["position"])


def inspect_module(module: Any) -> Inspected:
    """:class:`Inspected` for a transformed or loaded module (its latest plan)."""
    from fxckpt.errors import ConfigError
    from fxckpt.inspection import inspect

    try:
        seen = inspect(module)
    except ConfigError:
        raise TypeError(f"expected a module returned by fxckpt.transform or fxckpt.load "
                        f"(got {type(module).__name__})") from None
    return Inspected(seen.plan, seen.view)


def memory_unit(peak: float) -> tuple[str, float]:
    """The unit an axis showing up to ``peak`` bytes reads best in, and its size in bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= 4 * scale:
            return unit, float(scale)
    return "bytes", 1.0


def segment_colors(names: list[str]) -> dict[str, Any]:
    """A distinct colour per segment: tab10, tab20 beyond 10 segments, hsv beyond 20."""
    import matplotlib

    if len(names) <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return {name: cmap(i) for i, name in enumerate(names)}
    if len(names) <= 20:
        cmap = matplotlib.colormaps["tab20"]
        return {name: cmap(i) for i, name in enumerate(names)}
    cmap = matplotlib.colormaps["hsv"]
    return {name: cmap(i / len(names)) for i, name in enumerate(names)}


def stage_colors(count: int) -> list[Any]:
    """Edge colours per pipeline stage (Dark2, repeated)."""
    import matplotlib

    cmap = matplotlib.colormaps["Dark2"]
    return [cmap(i % 8) for i in range(count)]

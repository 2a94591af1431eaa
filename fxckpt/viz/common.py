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

import colorsys
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
    from fxckpt.viz.inspection import inspect

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


WARM = (-60.0, 50.0)
"""Hue arc (degrees) of segment fills: magenta through red and orange to amber."""
COOL = (170.0, 250.0)
"""Hue arc of stage borders: teal through blue. The two never meet, so a fill is never
mistaken for a border."""


def _arc(count: int, arc: tuple[float, float]) -> list[float]:
    lo, hi = arc
    return [(lo + (hi - lo) * (i / max(count - 1, 1))) % 360.0 for i in range(count)]


def segment_colors(names: list[str]) -> dict[str, tuple[float, float, float]]:
    """A fill per segment from the warm hue family; neighbours differ in lightness too."""
    hues = _arc(len(names), WARM)
    return {name: colorsys.hsv_to_rgb(h / 360.0, 0.75, 0.95 if i % 2 == 0 else 0.7)
            for i, (name, h) in enumerate(zip(names, hues))}


def stage_colors(count: int) -> list[tuple[float, float, float]]:
    """A border colour per pipeline stage, dark, from the cool hue family."""
    return [colorsys.hsv_to_rgb(h / 360.0, 0.9, 0.6 if i % 2 == 0 else 0.4)
            for i, h in enumerate(_arc(count, COOL))]

"""The Pareto picture of each model: measured peak memory (x) against step time (y), every method.

fxckpt's points (the budget grid, the ``@peer`` and ``@minimum`` rows) are joined by a line in
order of memory, fxckpt's compiled points (``fxckpt_compiled``) are stars of the same colour;
each peer is a marker of its own, the unmodified model a cross. A peer point
above and to the right of fxckpt's line is dominated. The time axis is the median step time as
a ratio to the unmodified model's, timed by turns in the same process: the only time figure that
compares across processes on a shared machine (the targets use the same ratio).

The data is prepared by :func:`pareto_data` (plain values, tested on its own) and drawn by
:func:`plot_model`; matplotlib is optional (``pip install 'fxckpt[viz]'``) and imported only
there, through :mod:`fxckpt.viz.common`. :func:`write_plots` writes ``pareto_<model>.png`` next
to ``benchmarks.md``, which links them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from benchmarks.methods import PEERS

__all__ = ["Point", "ParetoData", "pareto_data", "plot_model", "write_plots", "MARKERS",
           "plot_name"]

log = logging.getLogger(__name__)

Row = dict[str, Any]

MARKERS = {"checkpoint_per_block": "s", "checkpoint_sequential": "D", "sac_ops": "^",
           "sac_megatron": "v", "compile": "P"}
"""A marker per peer (every method of :data:`benchmarks.methods.PEERS`)."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured configuration."""

    label: str
    peak: int
    """Measured peak activation memory (RSS protocol), bytes."""
    time: float
    """Median step time / the unmodified model's, timed by turns."""


@dataclasses.dataclass(frozen=True)
class ParetoData:
    """What one model's picture shows."""

    model: str
    fxckpt: tuple[Point, ...]
    """In order of memory (the line)."""
    peers: tuple[tuple[str, tuple[Point, ...]], ...]
    """``(method, points)`` per peer that has a measured point, in :data:`PEERS` order."""
    unmodified: Optional[Point]
    compiled: tuple[Point, ...] = ()
    """fxckpt's plans run under ``torch.compile`` (``fxckpt_compiled`` rows)."""


def _point(row: Row) -> Optional[Point]:
    ok = row.get("status") == "ok" and row.get("rss_bytes") and row.get("time_ratio")
    return Point(row["label"], int(row["rss_bytes"]), float(row["time_ratio"])) if ok else None


def pareto_data(rows: list[Row], model: str) -> ParetoData:
    """The measured (memory, time) points of ``model``'s rows, by method."""
    points = {m: [p for r in rows if r["model"] == model and r["method"] == m
                  if (p := _point(r)) is not None]
              for m in ("unmodified", "fxckpt", "fxckpt_compiled", *PEERS)}
    return ParetoData(
        model=model,
        fxckpt=tuple(sorted(points["fxckpt"], key=lambda p: (p.peak, p.time))),
        peers=tuple((m, tuple(points[m])) for m in PEERS if points[m]),
        unmodified=points["unmodified"][0] if points["unmodified"] else None,
        compiled=tuple(points["fxckpt_compiled"]),
    )


def plot_model(data: ParetoData, path: Optional[Path] = None) -> Any:
    """Draw one model's points (a ``matplotlib.figure.Figure``), saved to ``path`` when given."""
    from fxckpt.viz.common import finish, memory_unit, new_figure

    every = [*data.fxckpt, *data.compiled, *(p for _, ps in data.peers for p in ps)]
    every += [data.unmodified] if data.unmodified else []
    unit, scale = memory_unit(max((p.peak for p in every), default=1))
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot()
    if data.fxckpt:
        ax.plot([p.peak / scale for p in data.fxckpt], [p.time for p in data.fxckpt],
                marker="o", color="C0", label="fxckpt", gid="fxckpt", zorder=3)
    if data.compiled:
        ax.scatter([p.peak / scale for p in data.compiled], [p.time for p in data.compiled],
                   s=140, marker="*", color="C0", label="fxckpt + torch.compile",
                   gid="fxckpt_compiled", zorder=3)
    for i, (method, points) in enumerate(data.peers):
        ax.scatter([p.peak / scale for p in points], [p.time for p in points], s=60,
                   marker=MARKERS[method], color=f"C{i + 1}", label=method, gid=method)
    if data.unmodified:
        ax.scatter([data.unmodified.peak / scale], [data.unmodified.time], s=70, marker="X",
                   color="black", label="unmodified", gid="unmodified")
    ax.set_xlabel(f"measured peak activation memory ({unit})")
    ax.set_ylabel("median step time / unmodified")
    ax.set_title(f"{data.model}: memory against time (lower left is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return finish(fig, path)


def plot_name(model: str) -> str:
    return f"pareto_{model}.png"


def write_plots(rows: list[Row], out: Path) -> dict[str, str]:
    """``pareto_<model>.png`` in ``out`` for every model with a measured point; returns
    ``{model: file name}`` (empty, with a warning, when matplotlib is not installed)."""
    written: dict[str, str] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        data = pareto_data(rows, model)
        if not data.fxckpt and not data.peers and not data.compiled:
            continue
        try:
            plot_model(data, out / plot_name(model))
        except ImportError as e:
            log.warning("no Pareto pictures: %s", e)
            return {}
        written[model] = plot_name(model)
    return written

"""``fxckpt.show``: the graph the plan was made on, segments filled, stages outlined.

    inputs            grey = kept for backward (not in a segment)
      |               a warm fill per segment = freed in forward, recomputed in backward
    [layers.0]  ...   a cool border per pipeline stage (when the plan has stages)

Nodes are labelled with module paths, as the plan's tables name them; ops that only reshape or
index are hidden unless ``plumbing=True``.

Big graphs collapse to module level (see :mod:`fxckpt.viz.layout`). Every segment gets one
scatter artist labelled with its name, so a test (or a curious user) can count them.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import Any, Optional

from fxckpt.checks import check_int
from fxckpt.viz.common import (
    KEPT_COLOR,
    PathLike,
    finish,
    inspect_module,
    new_figure,
    segment_colors,
    stage_colors,
)
from fxckpt.viz.layout import Box, collapse, hide_plumbing, layout

__all__ = ["show"]

MAX_LEGEND = 16
LEGEND_WIDTH = 2.0
"""Inches the legend column takes on the right of the figure."""


def show(
    module: Any,
    path: Optional[PathLike] = None,
    *,
    max_nodes: int = 120,
    layout_engine: str = "auto",
    labels: Optional[bool] = None,
    plumbing: bool = False,
) -> Any:
    """Draw the graph of ``module`` (from ``fxckpt.transform`` or ``fxckpt.load``) with its plan.

    Args:
        module: a transformed or loaded module that has planned (its latest plan is drawn).
        path: also save the picture there (``.png``, ``.svg``, ``.pdf``).
        max_nodes: above this many ops, runs of ops from one module become one box.
        layout_engine: ``"auto"`` (Graphviz ``dot`` when installed), ``"dot"`` or ``"layered"``.
        labels: write node labels, module paths as the plan tables print them (``layers.0.fc``,
            ``layers.0: gelu``); default: when at most 60 boxes are drawn.
        plumbing: also draw ops that only reshape or index (views, ``getitem``, ``size``).

    Returns the ``matplotlib.figure.Figure``.
    """
    check_int("max_nodes", max_nodes)
    seen = inspect_module(module)
    view, ops = (seen.view, seen.ops()) if plumbing else hide_plumbing(seen.view, seen.ops())
    boxes, graph = collapse(view, ops, max_nodes)
    positions, engine = layout(graph, layout_engine)
    rows = Counter(y for _, y in positions.values())
    fig = new_figure(
        min(18.0, 5.0 + 0.25 * max(rows.values(), default=1)), min(18.0, 3.0 + 0.18 * len(rows))
    )
    ax = fig.add_subplot()
    _edges(ax, graph, positions)
    stages = sorted({b.stage for b in boxes if b.stage is not None})
    _nodes(ax, boxes, positions, [s.name for s in seen.plan.segments], stages)
    if labels if labels is not None else len(boxes) <= 60:
        for b in boxes:
            x, y = positions[b.name]
            ax.annotate(
                b.label, (x, y), xytext=(6, 0), textcoords="offset points", fontsize=6, va="center"
            )
    pipeline = seen.plan.pipeline
    _legend(ax, stages, {} if pipeline is None else {s.stage: s.device for s in pipeline.stages})
    collapsed = " (collapsed to modules)" if any(b.kind == "group" for b in boxes) else ""
    hidden = "" if plumbing else f", {len(seen.ops()) - len(ops)} plumbing op(s) hidden"
    # The title sits over the axes only: the legend has the column on the right to itself.
    wrap = max(40, int((fig.get_figwidth() - LEGEND_WIDTH) * 14))
    ax.set_title(
        textwrap.fill(seen.plan.summary(), wrap)
        + f"\n{len(boxes)} boxes{collapsed}{hidden}, {engine} layout",
        fontsize=8,
        loc="left",
    )
    ax.set_axis_off()
    return finish(fig, path)


def _edges(ax: Any, graph: Any, positions: dict) -> None:
    from matplotlib.collections import LineCollection

    lines = [(positions[u], positions[v]) for u, v in graph.edges()]
    ax.add_collection(
        LineCollection(lines, colors="#8a8a8a", linewidths=0.6, zorder=1, label="_data flow")
    )


def _nodes(
    ax: Any, boxes: list[Box], positions: dict, segments: list[str], stages: list[int]
) -> None:
    colors = segment_colors(segments)
    edge = dict(zip(stages, stage_colors(len(stages))))
    groups: list[tuple[str, Any, list[Box]]] = [("kept (not recomputed)", KEPT_COLOR, [])]
    groups += [(name, colors[name], []) for name in segments]
    index = {name: i + 1 for i, name in enumerate(segments)}
    for b in boxes:
        groups[index.get(b.segment, 0) if b.segment else 0][2].append(b)
    for label, color, members in groups:
        if not members and label.startswith("kept"):
            continue
        xs = [positions[b.name][0] for b in members]
        ys = [positions[b.name][1] for b in members]
        sizes = [40 + 8 * min(len(b.ops), 20) if b.kind == "group" else 40 for b in members]
        borders = [
            edge.get(b.stage, "#555555") if b.stage is not None else "#555555" for b in members
        ]
        markers = ax.scatter(xs, ys, s=sizes, c=[color] * len(members), edgecolors=borders,
                             linewidths=2.2 if stages else 0.5, zorder=2, label=label)
        markers.set_gid(label)


def _legend(ax: Any, stages: list[int], devices: dict[int, str]) -> None:
    from matplotlib.lines import Line2D

    handles, names = ax.get_legend_handles_labels()
    extra = len(handles) - MAX_LEGEND
    if extra > 0:
        handles, names = handles[:MAX_LEGEND], names[:MAX_LEGEND]
        handles.append(Line2D([], [], linestyle="none"))
        names.append(f"... {extra} more segment(s)")
    for stage, color in zip(stages, stage_colors(len(stages))):
        handles.append(Line2D([], [], marker="o", linestyle="none", markerfacecolor="white",
                              markeredgecolor=color, markeredgewidth=2))
        names.append(f"stage {stage} ({devices.get(stage, '?')})")
    ax.get_figure().legend(handles, names, fontsize=7, loc="outside right upper", frameon=False)


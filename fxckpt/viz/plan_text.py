"""A plan as people read it: the summary line, the segment table, the diff, and the pipeline.

:mod:`fxckpt.plan` holds the data; every text and HTML view of it is built here from the plan's
own figures (``Plan.summary()``, ``print(plan)``, a notebook's ``_repr_html_``, ``plan.diff``,
``PipelineView.lines()`` call these). The table layout itself is :mod:`fxckpt.viz.text`.
"""

from __future__ import annotations

import html
from typing import Any

from fxckpt.viz.text import aligned, count_kinds, format_bytes, html_table, shorten

__all__ = ["summary", "diff", "plan_text", "plan_html", "pipeline_head", "pipeline_rows",
           "pipeline_lines", "pipeline_html", "HEADER", "HINTS"]

Plan = Any
"""A :class:`fxckpt.plan.Plan`. Not imported: ``fxckpt.plan`` calls this module to print
itself, and the import graph has no cycle (``tests/test_imports.py``)."""
PipelineView = Any
"""A :class:`fxckpt.plan.PipelineView`."""
SegmentSpec = Any
"""A :class:`fxckpt.plan.SegmentSpec`."""

HEADER = ("segment", "modules", "nodes", "saved inputs", "frees", "recompute FLOPs",
          "kept outputs", "recomputes", "why")
"""The segment table's columns."""
HINTS = {
    "saved inputs": "segment inputs checkpoint holds for backward",
    "kept outputs": "outputs inside the segment kept from forward, not recomputed (selective)",
    "recomputes": "the ops run again in backward, by kind",
    "frees": "what the step no longer holds between forward and backward",
}
"""What a column means, shown when the HTML table's header is hovered."""


def summary(plan: Plan) -> str:
    """One line: strategy, segments, bytes kept and freed, recompute share, peak and budget
    (per micro-batch for a pipelined plan), all from the plan's own figures."""
    share = plan.recompute_share
    work = (f"recompute ~{share:.0%} of a forward pass" if share is not None
            else f"recompute {plan.recompute_flops:,} FLOPs")
    if share and plan.recompute_floor is not None:
        work += f" (any plan at this peak: at least {plan.recompute_floor:.0%})"
    return (
        f"{plan.strategy}: {len(plan.segments)} segment(s) over {plan.node_count} nodes, "
        f"saves {format_bytes(plan.saved_bytes)} of segment inputs{_kept(plan)}, frees "
        f"{format_bytes(plan.freed_bytes)}, {work}{_peak(plan)} ({plan.capture}, "
        f"{'train' if plan.training else 'eval'})"
    )


def _kept(plan: Plan) -> str:
    kept = [s for s in plan.segments if s.keeps]
    if not kept:
        return ""
    count = sum(len(s.keeps) for s in kept)
    return (f" and {count} output(s) of its ops "
            f"({format_bytes(sum(s.kept_bytes for s in kept))}, selective)")


def _peak(plan: Plan) -> str:
    per = " per micro-batch" if plan.micro_batched else ""
    peak, eager, text = plan.peak_bytes, plan.eager_peak_bytes, ""
    if peak is not None:
        kind = "verified" if plan.verified_peak is not None else "predicted"
        text = f"; {kind} peak {format_bytes(peak)}{per}"
        if eager:
            text += f" ({peak / eager:.0%} of {format_bytes(eager)} eager)"
    if plan.budget_bytes is not None:
        text += f" under a budget of {format_bytes(plan.budget_bytes)}{per}"
    return text


def diff(plan: Plan, other: Plan) -> str:
    """What changed from ``plan`` to ``other``: segments added, removed, resized; totals."""
    mine = {s.nodes: s for s in plan.segments}
    theirs = {s.nodes: s for s in other.segments}
    lines = [f"- {s.name}: {', '.join(s.module_paths)} ({len(s.nodes)} nodes)"
             for k, s in mine.items() if k not in theirs]
    lines += [f"+ {s.name}: {', '.join(s.module_paths)} ({len(s.nodes)} nodes)"
              for k, s in theirs.items() if k not in mine]
    for label, a, b in (
        ("segments", len(plan.segments), len(other.segments)),
        ("kept bytes", format_bytes(plan.saved_bytes), format_bytes(other.saved_bytes)),
        ("recompute FLOPs", f"{plan.recompute_flops:,}", f"{other.recompute_flops:,}"),
        ("peak", _opt_bytes(plan.peak_bytes), _opt_bytes(other.peak_bytes)),
    ):
        if a != b:
            lines.append(f"  {label}: {a} -> {b}")
    return "\n".join(lines) if lines else "the plans are the same"


def plan_html(plan: Plan) -> str:
    """The summary, the segment table, the notes and, when pipelined, stages and schedule."""
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in plan.notes)
    pipeline = "" if plan.pipeline is None else pipeline_html(plan.pipeline)
    return (f"<div><p><b>fxckpt plan</b>: {html.escape(summary(plan))}</p>"
            f"{html_table(HEADER, rows(plan), HINTS)}"
            f"{'<ul>' + notes + '</ul>' if notes else ''}{pipeline}</div>")


def rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row of the segment table per segment, in :data:`HEADER`'s columns."""
    return [
        (
            s.name,
            shorten(", ".join(s.module_paths) or "-", 40),
            str(len(s.nodes)),
            format_bytes(s.saved_bytes),
            format_bytes(s.freed_bytes),
            f"{s.recompute_flops:,}" if s.action == "recompute" else "offloaded",
            _kept_cell(s),
            shorten(count_kinds(s.recomputed_ops), 40) if s.action == "recompute" else "-",
            s.reason,
        )
        for s in plan.segments
    ]


def plan_text(plan: Plan) -> str:
    """``print(plan)``: the summary, the segment table, the notes, then the pipeline."""
    table = rows(plan)
    lines = [summary(plan), *(aligned(HEADER, table) if table else [])]
    lines += [f"note: {n}" for n in plan.notes]
    if plan.pipeline is not None:
        lines += ["", *pipeline_lines(plan.pipeline)]
    return "\n".join(lines)


def _kept_cell(s: SegmentSpec) -> str:
    return f"{count_kinds(s.kept_ops)} ({format_bytes(s.kept_bytes)})" if s.keeps else "-"


def _opt_bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def pipeline_head(view: PipelineView) -> str:
    """The pipeline in one line: stages, chunks, checkpoint mode, bubble, how it was cut."""
    return (f"pipeline: {len(view.stages)} stage(s), chunks={view.chunks}, "
            f"checkpoint={view.checkpoint}, bubble {view.bubble:.0%} ({view.method})")


def pipeline_rows(view: PipelineView, width: int = 50) -> list[tuple[str, ...]]:
    """The stage table: header row, then one row per stage (modules cut to ``width``)."""
    table: list[tuple[str, ...]] = [("stage", "device", "nodes", "cost", "modules")]
    table += [(str(s.stage), s.device, str(s.nodes), f"{s.cost:,.0f}",
               shorten(", ".join(s.modules) or "-", width)) for s in view.stages]
    return table


def pipeline_lines(view: PipelineView) -> list[str]:
    """The pipeline as text: a head line, the stage table and the schedule chart."""
    header, *table = pipeline_rows(view)
    return [pipeline_head(view), *aligned(header, table), view.schedule]


def pipeline_html(view: PipelineView) -> str:
    """The same as HTML: head line, stage table (full module lists), schedule chart."""
    header, *table = pipeline_rows(view, width=10_000)
    return (f"<p>{html.escape(pipeline_head(view))}</p>{html_table(header, table)}"
            f"<pre>{html.escape(view.schedule)}</pre>")

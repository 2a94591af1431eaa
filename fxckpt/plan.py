"""The Plan: every decision fxckpt made about one model and one input signature.

A Plan is plain data. It says which graph nodes are grouped into recompute segments, what each
segment keeps alive for backward (its inputs) and what it lets go (its intermediate tensors),
and how much work recomputing it costs. It prints as an aligned table, converts to JSON-ready
dicts and back, and never holds a reference to a graph or a tensor, so it can be saved, diffed
and handed back later.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fxckpt.runtime.schedule import bubble_fraction, checkpoint_stop, schedule_chart

__all__ = ["Plan", "PipelineView", "Segment", "StageView", "format_bytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """One recompute segment: a contiguous run of graph nodes run under checkpoint."""

    name: str
    """Attribute name of the segment's submodule in the rewritten graph (``segment_0``)."""
    nodes: tuple[str, ...]
    """Names of the captured graph's nodes in the segment, in topological order."""
    module_paths: tuple[str, ...]
    """The outermost module paths the segment's nodes came from."""
    inputs: tuple[str, ...]
    """Nodes outside the segment it reads; their tensors are what checkpoint keeps."""
    outputs: tuple[str, ...]
    """Nodes of the segment read outside it."""
    saved_bytes: int
    """Bytes of the tensor inputs kept for backward (parameters and buffers excluded)."""
    freed_bytes: int
    """Bytes of tensors the segment creates and does not keep (dropped until recompute)."""
    recompute_flops: int
    """FLOPs of running the segment's forward again in backward."""
    restores: tuple[str, ...]
    """Buffers the segment writes (BatchNorm statistics); put back after each recompute."""
    reason: str
    """Why the segment exists, e.g. ``every=2: units 4-5`` or ``depth=2: layers.3``."""
    action: str = "recompute"
    """``recompute`` (checkpoint) or ``offload`` (kept, with its saved tensors in host memory)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Segment":
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageView:
    """One pipeline stage as the plan shows it."""

    stage: int
    device: str
    nodes: int
    """Nodes of the planned graph the stage runs (a checkpointed segment counts its nodes)."""
    cost: float
    """Predicted cost: forward plus recompute FLOPs (bytes allocated when balanced by memory)."""
    modules: tuple[str, ...]
    """The outermost module paths the stage's nodes came from, in the order they run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineView:
    """A pipelined plan's stages and schedule: the facts, rendered to text by :meth:`lines`."""

    stages: tuple[StageView, ...]
    chunks: int
    """Micro-batches per call."""
    checkpoint: str
    """``always``, ``except_last`` or ``never``: which micro-batches each stage recomputes."""
    stop: int
    """Micro-batches ``i < stop`` are checkpointed (torchgpipe's ``checkpoint_stop``)."""
    method: str
    """How the stages were cut: ``balanced`` or the ``balance=`` given."""
    stage_of: dict[str, int]
    """Compute node name -> stage index."""
    cost: str = "flops"
    """What the stage costs count: ``flops`` or ``memory`` (bytes allocated)."""

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.stages)

    @property
    def bubble(self) -> float:
        """The idle share of the fill-drain schedule, ``(K - 1) / (M + K - 1)``."""
        return bubble_fraction(self.chunks, len(self.stages))

    @property
    def schedule(self) -> str:
        """The forward schedule as ASCII, checkpointed pairs marked."""
        return schedule_chart(self.chunks, len(self.stages), recompute_stop=self.stop)

    def lines(self) -> list[str]:
        """The pipeline as text: a head line, the stage table and the schedule chart."""
        rows = [("stage", "device", "nodes", "cost", "modules")]
        rows += [(str(s.stage), s.device, str(s.nodes), f"{s.cost:,.0f}",
                  _shorten(", ".join(s.modules), 50)) for s in self.stages]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        head = (f"pipeline: {len(self.stages)} stage(s), chunks={self.chunks}, "
                f"checkpoint={self.checkpoint}, bubble {self.bubble:.0%} ({self.method})")
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return [head, *table, self.schedule]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``bubble`` and ``schedule`` are written for readers of the file."""
        return {"chunks": self.chunks, "checkpoint": self.checkpoint, "stop": self.stop,
                "method": self.method, "cost": self.cost,
                "stages": [{**dataclasses.asdict(s), "modules": list(s.modules)}
                           for s in self.stages],
                "stage_of": dict(self.stage_of), "bubble": self.bubble, "schedule": self.schedule}

    @classmethod
    def from_dict(cls, d: dict[str, Any], training: bool) -> "PipelineView":
        """From :meth:`to_dict` (plans saved before ``stop`` was kept: from ``checkpoint``)."""
        chunks, checkpoint = int(d["chunks"]), str(d["checkpoint"])
        stop = d.get("stop", checkpoint_stop(chunks, checkpoint) if training else 0)
        stages = tuple(StageView(stage=s["stage"], device=s["device"], nodes=s["nodes"],
                                 cost=s["cost"], modules=tuple(s["modules"])) for s in d["stages"])
        return cls(stages=stages, chunks=chunks, checkpoint=checkpoint, stop=int(stop),
                   method=str(d["method"]), stage_of=dict(d["stage_of"]),
                   cost=str(d.get("cost", "flops")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """All of fxckpt's decisions for one model, mode and input signature."""

    strategy: str
    """``every``, ``depth``, ``force`` or ``none``."""
    options: dict[str, Any]
    """The options the strategy was given (``{"every": 2, "depth": None, "force": {}}``)."""
    capture: str
    """How the graph was captured: ``symbolic_trace`` or ``export``."""
    training: bool
    """The module mode the graph was captured in."""
    signature: str
    """A readable description of the inputs the plan was made for."""
    segments: tuple[Segment, ...]
    node_count: int
    """Nodes of the captured graph that compute something (placeholders and outputs excluded)."""
    total_flops: int
    """FLOPs of one forward pass of the unmodified graph."""
    notes: tuple[str, ...] = ()
    """Decisions worth telling the user (adjusted cuts, nothing to checkpoint, ...)."""
    eager_peak: int | None = None
    """Predicted peak activation memory of a training step of the unmodified graph (bytes)."""
    predicted_peak: int | None = None
    """Predicted peak activation memory of a training step with this plan (bytes)."""
    predicted_recompute: float | None = None
    """Predicted recompute cost (the simulator's cost units: FLOPs, or bytes for memory-bound ops).
    """
    budget: int | None = None
    """The budget the plan was solved for (bytes), if any."""
    pipeline: PipelineView | None = None
    """The stages and schedule, when the plan is pipelined."""
    verified_peak: int | None = None
    """Peak activation memory of a training step with this plan as executed on fake tensors
    under a live-storage tracker (bytes): every temporary of backward counted. ``None`` when the
    plan was not verified."""
    verified_eager_peak: int | None = None
    """The same for the unmodified graph (what a fractional budget is a fraction of)."""

    @property
    def peak_bytes(self) -> int | None:
        """The plan's peak activation memory: the verified figure when there is one, else the
        predicted. Every view (summary, HTML, pictures, report, CLI) shows this one."""
        return self.verified_peak if self.verified_peak is not None else self.predicted_peak

    @property
    def eager_peak_bytes(self) -> int | None:
        """The unmodified step's peak, measured the same way as :attr:`peak_bytes`."""
        if self.verified_peak is not None and self.verified_eager_peak is not None:
            return self.verified_eager_peak
        return self.eager_peak

    @property
    def saved_bytes(self) -> int:
        """Bytes all segments keep for backward."""
        return sum(s.saved_bytes for s in self.segments)

    @property
    def recompute_flops(self) -> int:
        """FLOPs recomputed in one backward pass."""
        return sum(s.recompute_flops for s in self.segments)

    def segment_of(self, node: str) -> str | None:
        """The name of the segment that holds ``node``, or ``None``."""
        for seg in self.segments:
            if node in seg.nodes:
                return seg.name
        return None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["segments"] = [s.to_dict() for s in self.segments]
        d["notes"] = list(self.notes)
        d["pipeline"] = None if self.pipeline is None else self.pipeline.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        d["segments"] = tuple(Segment.from_dict(s) for s in d["segments"])
        d["notes"] = tuple(d.get("notes", ()))
        if d.get("pipeline") is not None:
            d["pipeline"] = PipelineView.from_dict(d["pipeline"], bool(d["training"]))
        return cls(**d)

    def summary(self) -> str:
        """One line: strategy, segments, saved bytes, recompute overhead, predicted peak."""
        overhead = self.recompute_flops / self.total_flops if self.total_flops else 0.0
        peak = ""
        if self.predicted_peak is not None and self.eager_peak:
            peak = (f", predicted peak {format_bytes(self.predicted_peak)} "
                    f"({self.predicted_peak / self.eager_peak:.0%} of eager)")
        if self.budget is not None:
            peak += f" under a budget of {format_bytes(self.budget)}"
        return (
            f"{self.strategy}: {len(self.segments)} segment(s) over {self.node_count} nodes, "
            f"keeps {format_bytes(self.saved_bytes)} of segment inputs, recomputes "
            f"{overhead:.0%} of forward FLOPs{peak} ({self.capture}, "
            f"{'train' if self.training else 'eval'})"
        )

    def diff(self, other: "Plan") -> str:
        """What changed from this plan to ``other``: segments added, removed, resized; totals."""
        mine = {s.nodes: s for s in self.segments}
        theirs = {s.nodes: s for s in other.segments}
        lines = [f"- {s.name}: {', '.join(s.module_paths)} ({len(s.nodes)} nodes)"
                 for k, s in mine.items() if k not in theirs]
        lines += [f"+ {s.name}: {', '.join(s.module_paths)} ({len(s.nodes)} nodes)"
                  for k, s in theirs.items() if k not in mine]
        for label, a, b in (
            ("segments", len(self.segments), len(other.segments)),
            ("kept bytes", format_bytes(self.saved_bytes), format_bytes(other.saved_bytes)),
            ("recompute FLOPs", f"{self.recompute_flops:,}", f"{other.recompute_flops:,}"),
            ("predicted peak", _opt_bytes(self.predicted_peak), _opt_bytes(other.predicted_peak)),
        ):
            if a != b:
                lines.append(f"  {label}: {a} -> {b}")
        return "\n".join(lines) if lines else "the plans are the same"

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{h}</th>" for h in _HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self._rows()
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<div><p><b>fxckpt plan</b>: {html.escape(self.summary())}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"{'<ul>' + notes + '</ul>' if notes else ''}</div>")

    def _rows(self) -> list[tuple[str, ...]]:
        return [
            (
                s.name,
                _shorten(", ".join(s.module_paths) or "-", 40),
                str(len(s.nodes)),
                format_bytes(s.saved_bytes),
                format_bytes(s.freed_bytes),
                f"{s.recompute_flops:,}" if s.action == "recompute" else "offloaded",
                s.reason,
            )
            for s in self.segments
        ]

    def __str__(self) -> str:
        header, rows = _HEADER, self._rows()
        lines = [self.summary()]
        if rows:
            widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
            lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
            lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += [f"note: {n}" for n in self.notes]
        if self.pipeline is not None:
            lines += ["", *self.pipeline.lines()]
        return "\n".join(lines)


_HEADER = ("segment", "modules", "nodes", "keeps", "frees", "recompute FLOPs", "why")


def _opt_bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."

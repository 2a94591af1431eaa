"""The Plan: every decision fxckpt made about one model and one input signature.

A Plan is plain data. It says which graph nodes are grouped into recompute segments, what each
segment keeps alive for backward (its inputs) and what it lets go (its intermediate tensors),
and how much work recomputing it costs. It converts to JSON-ready dicts and back, and never holds
a reference to a graph or a tensor, so it can be saved, diffed and handed back later. It prints
as an aligned table, shows as HTML and diffs through :mod:`fxckpt.viz.plan_text`, where every
view of it is built.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from fxckpt.runtime.schedule import bubble_fraction, checkpoint_stop, schedule_chart
from fxckpt.viz.text import format_bytes

__all__ = ["Plan", "PipelineView", "SegmentSpec", "StageView", "format_bytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentSpec:
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
    """The "frees" column: bytes an unmodified step would hold from the end of forward until
    backward reaches the segment, which checkpointing it lets go of (the tensors its nodes save
    for backward, dropout masks and a leaf module's insides included; its outputs excluded, as
    the next segment or the loss keeps them). Summed over segments, less what ``saved_bytes`` adds
    back, it is how much less the step holds between forward and backward; the peak falls by less
    than that, because backward needs room to recompute one segment."""
    recompute_flops: int
    """FLOPs of running the segment's forward again in backward."""
    restores: tuple[str, ...]
    """Buffers the segment writes (BatchNorm statistics); put back after each recompute."""
    reason: str
    """Why the segment exists, e.g. ``every=2: units 4-5`` or ``depth=2: layers.3``."""
    action: str = "recompute"
    """``recompute`` (checkpoint) or ``offload`` (kept, with its saved tensors in host memory)."""
    keeps: tuple[str, ...] = ()
    """Nodes of the segment whose outputs are kept from forward, not recomputed (selective
    recompute: matmuls and the like, see :mod:`fxckpt.planning.keeps`)."""
    kept_bytes: int = 0
    """Bytes of the kept outputs, held from forward until the segment's recompute."""
    kept_ops: tuple[str, ...] = ()
    """The op kind of each kept node (``addmm``, ``convolution``), for the tables."""
    recomputed_ops: tuple[str, ...] = ()
    """The op kind of each node run again in backward (views left out)."""
    forward_cost: float = 0.0
    """What one forward run of the segment is priced at, in the plan's cost units
    (FLOP-equivalents): what the step's measured segment times are compared with
    (:mod:`fxckpt.serve.refine`)."""
    compiled_keeps: tuple[str, ...] = ()
    """Aten ops (``mm``, ``addmm``, attention kernels) whose outputs the segment keeps when the
    step runs under ``torch.compile``, as a selective-checkpoint policy of the compiled
    recompute: a plan fitted to the compiled step (:mod:`fxckpt.measure.compiled_step`) keeps
    matmuls, and inductor recomputes the pointwise ops between them fused into backward."""
    anchors: tuple[str, ...] = ()
    """What the segment's first and last node, then each kept node, are (module, op, occurrence;
    :mod:`fxckpt.planning.anchors`): how a replay finds the segment in a graph captured elsewhere
    (a plan made on the ``meta`` device, replayed on the real one), where node names differ."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SegmentSpec":
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

    def head(self) -> str:
        from fxckpt.viz.plan_text import pipeline_head

        return pipeline_head(self)

    def rows(self, width: int = 50) -> list[tuple[str, ...]]:
        """The stage table: header row, then one row per stage (modules cut to ``width``)."""
        from fxckpt.viz.plan_text import pipeline_rows

        return pipeline_rows(self, width)

    def lines(self) -> list[str]:
        """The pipeline as text: a head line, the stage table and the schedule chart."""
        from fxckpt.viz.plan_text import pipeline_lines

        return pipeline_lines(self)

    def html(self) -> str:
        """The same as HTML: head line, stage table (full module lists), schedule chart."""
        from fxckpt.viz.plan_text import pipeline_html

        return pipeline_html(self)

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
    segments: tuple[SegmentSpec, ...]
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
    recompute_share: float | None = None
    """What recompute adds to a step, as a share of one forward pass: the cost of the ops run
    again over the cost of all ops, both estimated from FLOPs plus memory traffic (see
    :mod:`fxckpt.cost.bridge`), so a dropout or GELU recomputed counts though it does few
    FLOPs; the fixed per-segment overhead is left out. The one recompute percentage every view
    shows (summary, HTML, Pareto chart)."""
    recompute_floor: float | None = None
    """No plan whose predicted peak is this plan's recomputes less than this share of a forward
    pass (a lower bound, :mod:`fxckpt.solver.floor`, whatever strategy made the plan): the
    certificate :attr:`gap` is measured against."""
    budget_bytes: int | None = None
    """The budget the plan was solved for, in bytes (the user's :class:`~fxckpt.budget.Budget`
    resolved for this call), if any."""
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
    def budget(self) -> int | None:
        """Deprecated: :attr:`budget_bytes` (a budget is what the user writes, ``"6GiB"``)."""
        warnings.warn("Plan.budget is deprecated: use Plan.budget_bytes", DeprecationWarning,
                      stacklevel=2)
        return self.budget_bytes

    @property
    def eager_peak_bytes(self) -> int | None:
        """The unmodified step's peak, measured the same way as :attr:`peak_bytes`."""
        if self.verified_peak is not None and self.verified_eager_peak is not None:
            return self.verified_eager_peak
        return self.eager_peak

    @property
    def gap(self) -> float | None:
        """The share of its recompute this plan might still save: ``(share - floor) / share``
        (0 for a plan that recomputes nothing or meets its floor; ``None`` without a floor)."""
        share, floor = self.recompute_share, self.recompute_floor
        if share is None or floor is None:
            return None
        return (share - floor) / share if share > floor and share > 0 else 0.0

    @property
    def micro_batched(self) -> bool:
        """Whether the plan is for one micro-batch of a pipelined step (``chunks=``): its peaks
        and budget are per micro-batch, not per step."""
        return self.pipeline is not None

    @property
    def saved_bytes(self) -> int:
        """Bytes all segments keep for backward."""
        return sum(s.saved_bytes for s in self.segments)

    @property
    def freed_bytes(self) -> int:
        """Bytes all segments free between forward and backward (``SegmentSpec.freed_bytes``)."""
        return sum(s.freed_bytes for s in self.segments)

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
        if "budget" in d:  # written before the field was named budget_bytes
            d["budget_bytes"] = d.pop("budget")
        d["segments"] = tuple(SegmentSpec.from_dict(s) for s in d["segments"])
        d["notes"] = tuple(d.get("notes", ()))
        if d.get("pipeline") is not None:
            d["pipeline"] = PipelineView.from_dict(d["pipeline"], bool(d["training"]))
        return cls(**d)

    def summary(self) -> str:
        """One line: strategy, segments, bytes kept and freed, recompute share, peak and budget
        (per micro-batch for a pipelined plan), all from the plan's own figures."""
        from fxckpt.viz.plan_text import summary

        return summary(self)

    def diff(self, other: "Plan") -> str:
        """What changed from this plan to ``other``: segments added, removed, resized; totals."""
        from fxckpt.viz.plan_text import diff

        return diff(self, other)

    def _repr_html_(self) -> str:
        """The summary, the segment table, the notes and, when pipelined, stages and schedule."""
        from fxckpt.viz.plan_text import plan_html

        return plan_html(self)

    def __str__(self) -> str:
        from fxckpt.viz.plan_text import plan_text

        return plan_text(self)

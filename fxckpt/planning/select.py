"""Select: run the strategy's pass, apply the rules every segment obeys, and build the Plan.

    annotated gm --bridge--> Problem --strategy pass--> runs --cleanup--> segments --> Plan
                                                                  (force, in-place, hooks)

A segment is a contiguous run of compute nodes in topological order. The Plan records, for each,
what it keeps (its inputs), what it frees, its recompute FLOPs and why it exists, and for the
whole plan the simulator's predicted peak and recompute cost (:mod:`fxckpt.cost.prediction`),
so every strategy reports comparable numbers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Optional, Sequence

import torch.fx

from fxckpt.config import TransformConfig
from fxckpt.planning.actions import decide_actions
from fxckpt.cost.annotate import has_info, info
from fxckpt.planning.cleanup import (force_notes, pinned, without_hooked,
                                     without_mode_switches)
from fxckpt.cost import refined
from fxckpt.cost.bridge import priced_problem
from fxckpt.planning.anchors import anchors_of
from fxckpt.planning.keeps import Groups, choices, module_pins, op_kind
from fxckpt.capture.graphs import outermost, planned_nodes
from fxckpt.cost.devices import copies_overlap
from fxckpt.cost.prediction import Prediction, floor_share, predict
from fxckpt.cost.rates import device_of
from fxckpt.cost.runs import Run, keep_positions, kept_names, recomputed, to_spans
from fxckpt.planning.fit import Target
from fxckpt.planning.overlap import Overlapped, overlapped
from fxckpt.planning.strategies import Placement, place
from fxckpt.plan import Plan, SegmentSpec
from fxckpt.solver import Problem
from fxckpt.strategy import Budgeted, Replay

__all__ = ["select"]

log = logging.getLogger(__name__)


def select(
    gm: torch.fx.GraphModule,
    config: TransformConfig,
    *,
    capture: str,
    training: bool,
    signature: str,
    hooked: Mapping[str, str] = {},
    target: Target = Target(),
    loss_bytes: Optional[int] = None,
) -> Plan:
    """Choose segments for the annotated ``gm`` as ``config`` asks.

    ``hooked`` maps nodes that must never be recomputed (calls of modules with hooks, which would
    fire again) to their module paths; they are taken out of every segment. ``target`` is where
    verification steers a budget (:mod:`fxckpt.planning.fit`). ``loss_bytes``: what the user's
    loss was measured holding (:func:`fxckpt.measure.loss_probe.fake_loss_peak`; ``None``:
    assumed).
    """
    order = planned_nodes(gm.graph)
    replay = config.strategy if isinstance(config.strategy, Replay) else None
    auto = config.offload == "auto" and replay is None
    problem = priced_problem(gm, config.device_profile, loss_bytes, offload=auto,
                             bandwidth=config.offload_bandwidth,
                             host=config.offload_device or "cpu")
    modules = module_pins(config.force)
    offered, forced = choices(problem, order, config.force)

    def lay(priced: Problem) -> _Laid:
        placement = place(config.strategy, order, priced, modules, target,
                          (offered if config.selective else [], forced))
        runs, hooked_notes = without_hooked(order, list(placement.runs), hooked)
        runs = without_mode_switches(order, runs)
        again = recomputed(priced, runs)
        return _Laid(placement, runs, hooked_notes, again,
                     _kept(priced, again, placement.keeps, forced, replay))

    beside = None
    if auto and copies_overlap(config.device_profile, device_of(gm)):
        beside = overlapped(problem, lay, lambda laid: (
            to_spans(problem, laid.runs), keep_positions(problem, laid.kept)),
            search=isinstance(config.strategy, Budgeted))
        laid = beside.laid
    else:
        laid = lay(problem)
    placement, runs, again, kept = laid.placement, laid.runs, laid.again, laid.kept
    prediction = predict(problem, runs, kept)
    floor = None
    if beside is not None:
        prediction, floor = _beside(problem, prediction, beside, len(runs))
    notes = [*placement.notes, *laid.hooked_notes, *force_notes(order, runs, modules),
             *_budget_notes(config, placement.budget_bytes, target, prediction.peak, replay)]
    factor = refined.scale()
    if factor != 1.0:
        notes.append(f"ops priced at x{factor:.2f} their measured prices: the factor "
                     "the first training steps' segments ran at (fxckpt.serve.refine)")
    prefix, anchors = _segment_prefix(gm, len(runs)), anchors_of(order)
    costs = {op.name: op.cost for op in problem.ops}
    segments = tuple(_describe(f"{prefix}_{i}", run, rerun, frees, config, kept, anchors, costs)
                     for i, (run, rerun, frees) in enumerate(zip(runs, again, prediction.frees)))
    if beside is not None:
        segments = tuple(dataclasses.replace(s, action="offload" if off else "recompute")
                         for s, off in zip(segments, beside.offloads))
        notes.append(_beside_note(beside))
    elif auto:
        segments, note = decide_actions(problem, segments, runs)
        notes.append(note)
    elif replay is not None:
        segments = tuple(dataclasses.replace(s, action=r.action)
                         for s, r in zip(segments, replay.plan.segments))
    if not segments:
        notes.append(_why_none(config, placement.why_none, training))
    plan = Plan(
        strategy=config.strategy_name, options=config.to_dict(), capture=capture,
        training=training, signature=signature, segments=segments, node_count=len(order),
        total_flops=sum(info(n).flops for n in order), notes=tuple(notes),
        eager_peak=prediction.eager_peak, predicted_peak=prediction.peak,
        predicted_recompute=prediction.recompute, recompute_share=prediction.share,
        recompute_floor=floor_share(problem, prediction.peak) if floor is None else floor,
        budget_bytes=placement.budget_bytes,
    )
    _log(plan)
    return plan


@dataclasses.dataclass(frozen=True)
class _Laid:
    """A placement with the clean-up every segment obeys applied."""

    placement: Placement
    runs: list[Run]
    hooked_notes: Sequence[str]
    again: list[Run]
    """Per run, the part its recompute runs."""
    kept: tuple[str, ...]


def _beside(problem: Problem, prediction: Prediction, beside: Overlapped, segments: int
            ) -> tuple[Prediction, float]:
    """The prediction of a plan whose offloads run beside the compute, and its floor.

    Its cost is what :func:`fxckpt.planning.overlap.cost` says: offloaded segments recompute
    nothing. Its floor is the floor without offload at its peak plus the room: take any plan
    at that peak that moves at most the room's bytes, and stop checkpointing the segments it
    offloads. That plan only recomputes, costs no more (it runs those segments once, as the
    offloading one does), and holds at most the bytes they moved beyond the same peak. So no
    plan that offloads within the room recomputes less than the floor at peak + room."""
    ix = problem.index
    forward = ix.cum_cost[-1]
    share = (beside.cost - segments * ix.overhead) / forward if forward else 0.0
    plain = dataclasses.replace(problem, offload_cost_per_byte=None)
    return (dataclasses.replace(prediction, recompute=beside.cost, share=share),
            floor_share(plain, prediction.peak + beside.room))


def _beside_note(beside: Overlapped) -> str:
    count = sum(beside.offloads)
    mib = 1 << 20
    tail = ("searched without offload only" if beside.tried == 1 else
            f"the best of {beside.tried} plans searched, " + (
                "the one without offload" if beside.price is None
                else f"searched at {beside.price:.3g} FLOP-equivalents a byte moved"))
    return (f"offload='auto' with copies beside the compute: {count} of {len(beside.offloads)} "
            f"segment(s) offload {beside.moved / mib:.1f} MiB, within the "
            f"{beside.room / mib:.1f} MiB the host link moves while the forward runs; the rest "
            f"recompute ({tail}; fxckpt.planning.overlap)")


def _budget_notes(config: TransformConfig, budget: Optional[int], target: Target, peak: int,
                  replay: Optional[Replay]) -> list[str]:
    """What the plan says about its budget: a predicted peak the clean-up moved over it (a
    target raised past the budget by fit's loosening is over it on purpose), and a pipelined
    budget bounding one micro-batch."""
    notes = []
    allowed = None if budget is None else target.allowed(budget)
    if allowed is not None and replay is None and peak > allowed:
        notes.append(f"clean-up moved segments; predicted peak {peak} B is over the budget "
                     f"{budget} B")
    if config.pipelined and budget is not None:
        notes.append(
            f"the budget bounds one micro-batch's step (chunks={config.chunks or 1}): a pipelined "
            "step also holds what each stage keeps for the other micro-batches (docs/pipelines.md)"
        )
    return notes


def _log(plan: Plan) -> None:
    log.info("fxckpt plan: %s", plan.summary())
    for seg in plan.segments:
        log.info("  %s: %s (%d nodes, %s)", seg.name, ", ".join(seg.module_paths) or "-",
                 len(seg.nodes), seg.reason)


def _why_none(config: TransformConfig, why: Optional[str], training: bool) -> str:
    what, tail = "nothing is checkpointed", ""
    if config.pipelined and training and config.checkpoint != "never":
        what = "no segment is checkpointed within a micro-batch"
        tail = (f"; the pipeline still recomputes each stage of the micro-batches "
                f"checkpoint={config.checkpoint!r} names")
    if config.strategy_name == "none":
        return f"{what}: no strategy was given{tail}"
    return (why or f"{what}: the strategy found no segment") + tail


def _segment_prefix(gm: torch.fx.GraphModule, count: int) -> str:
    """``segment``, or a longer prefix if the graph module already has ``segment_<i>`` attributes.
    """
    prefix = "segment"
    while any(hasattr(gm, f"{prefix}_{i}") for i in range(count)):
        prefix = "fxckpt_" + prefix
    return prefix


def _kept(problem: Problem, again: Sequence[Run], chosen: Sequence[str], forced: Groups,
           replay: Optional[Replay]) -> tuple[str, ...]:
    """Nodes kept inside the final runs: the solver's choice, a replayed plan's, the pinned ops;
    only nodes the recompute runs again (``again``: past a run's early stop, keeping saves
    nothing)."""
    inside = {n.name for r in again for n in r}
    wanted = set(chosen) | set(kept_names(problem, [j for g in forced for j in g]))
    if replay is not None:
        wanted = set(chosen)
    return tuple(n.name for r in again for n in r if n.name in wanted and n.name in inside)


def _describe(name: str, run: Run, again: Run, frees: int, config: TransformConfig,
              kept: Sequence[str] = (), anchors: Mapping[str, str] = {},
              costs: Mapping[str, float] = {}) -> SegmentSpec:
    """One segment's facts; ``again`` is the part of ``run`` its recompute runs; ``costs``: the
    problem's price of each op."""
    members, names = set(run), set(kept)
    kept_nodes = [n for n in again if n.name in names]
    inputs: list[torch.fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in inputs:
                inputs.append(a)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    return SegmentSpec(
        name=name,
        nodes=tuple(n.name for n in run),
        module_paths=outermost(info(n).module_path for n in run),
        inputs=tuple(a.name for a in inputs),
        outputs=tuple(n.name for n in outputs),
        saved_bytes=_saved_bytes(inputs),
        freed_bytes=frees,
        recompute_flops=(sum(info(n).flops for n in again)
                         - sum(info(n).flops for n in kept_nodes)),
        restores=tuple(sorted({b for n in run for b in info(n).writes_buffers})),
        reason=_reason(run, config),
        keeps=tuple(n.name for n in kept_nodes),
        kept_bytes=sum(info(n).new_bytes + info(n).saves_internal_bytes for n in kept_nodes),
        kept_ops=tuple(op_kind(n) for n in kept_nodes),
        recomputed_ops=tuple(k for n in again if n not in kept_nodes for k in [op_kind(n)] if k),
        anchors=(tuple(anchors[n.name] for n in [run[0], run[-1], *kept_nodes]) if anchors
                 else ()),
        forward_cost=sum(costs.get(n.name, 0.0) for n in run),
    )


def _saved_bytes(inputs: Sequence[torch.fx.Node]) -> int:
    return sum(info(a).nbytes for a in inputs if has_info(a) and not info(a).is_state)


def _reason(run: Run, config: TransformConfig) -> str:
    if config.force and pinned(run[0], config.force) == "recompute":
        return "force: recompute"
    return "force" if config.strategy is None else config.strategy.reason()

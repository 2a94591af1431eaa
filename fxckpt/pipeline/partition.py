"""Partition: choose where an annotated graph is cut into K contiguous pipeline stages.

:func:`partition` is an analysis pass. It costs every compute node from its annotation -- FLOPs,
twice for nodes that are recomputed (inside a checkpoint segment of the Plan, or behind a lowered
``fxckpt.checkpoint`` call) -- and asks :func:`fxckpt.solver.stages.partition` for the cuts
that minimise the slowest stage. A cut is never placed where it would break something:

* between a multi-output op (or a lowered checkpoint call) and its ``getitem`` nodes;
* inside a checkpoint segment of the Plan (when the graph is not lowered yet);
* where a later stage would write in place to a tensor made by an earlier stage (a checkpointed
  stage would see its input changed when it recomputes).

The stage assignment (:class:`StagePlan`) is data; :mod:`fxckpt.pipeline.split` turns it into
one GraphModule per stage.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import operator
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx

from fxckpt.errors import ConfigError
from fxckpt.cost.annotate import has_info, info
from fxckpt.capture.graphs import compute_nodes, is_guard, outermost
from fxckpt.plan import Plan
from fxckpt.runtime.checkpoint import checkpoint as _checkpoint_fn
from fxckpt.runtime.offload import offload_region
from fxckpt.solver import stages as solver

__all__ = ["StagePlan", "partition", "stage_order", "node_costs", "legal_cuts"]

log = logging.getLogger(__name__)

Balance = Union[Sequence[int], Sequence[str]]
COSTS = ("flops", "memory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Which stage every compute node runs in, and what each stage is predicted to cost."""

    stage_of: dict[str, int]
    """Compute node name -> stage index (contiguous, in topological order)."""
    nodes: tuple[tuple[str, ...], ...]
    """The compute nodes of each stage, in order."""
    costs: tuple[float, ...]
    """Predicted cost per stage: forward plus recompute FLOPs (or bytes, for ``cost="memory"``)."""
    module_paths: tuple[tuple[str, ...], ...]
    """The outermost module paths each stage's nodes came from, in the order they run (a
    lowered segment's call names the modules of the nodes inside it)."""
    planned: tuple[int, ...] = ()
    """Nodes of the planned graph each stage runs: a lowered segment counts the nodes inside it,
    so the counts add up to ``Plan.node_count``."""
    method: str
    """``balanced`` (the DP), ``balance=[counts]`` or ``balance=[module paths]``."""
    cost: str = "flops"

    @property
    def stages(self) -> int:
        return len(self.nodes)

    @property
    def bottleneck(self) -> float:
        """The slowest stage's predicted cost."""
        return max(self.costs)

    def to_dict(self) -> dict[str, Any]:
        return {"stage_of": dict(self.stage_of), "nodes": [list(n) for n in self.nodes],
                "costs": list(self.costs), "module_paths": [list(m) for m in self.module_paths],
                "method": self.method, "cost": self.cost, "planned": list(self.planned)}

    def __str__(self) -> str:
        total = sum(self.costs) or 1.0
        rows = [("stage", "nodes", self.cost, "share", "modules")]
        for s, (nodes, c, mods) in enumerate(zip(self.nodes, self.costs, self.module_paths)):
            shown = ", ".join(mods) or "-"
            rows.append((str(s), str(len(nodes)), f"{c:,.0f}", f"{c / total:.0%}",
                         shown if len(shown) <= 50 else shown[:47] + "..."))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            f"{self.stages} stage(s), {self.method}; slowest stage "
            f"{self.bottleneck:,.0f} {self.cost}"
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)


def stage_order(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes a stage assignment covers: every compute node, in topological order."""
    return list(compute_nodes(gm.graph))


def _is_checkpoint_call(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is _checkpoint_fn


def _segment_body(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Optional[torch.fx.GraphModule]:
    """The segment a lowered call runs (``checkpoint(segment_0, ...)``, or an offload region)."""
    lowered = n.op == "call_function" and n.target in (_checkpoint_fn, offload_region)
    target = n.args[0] if lowered and n.args else None
    if not isinstance(target, torch.fx.Node) or target.op != "get_attr":
        return None
    sub = getattr(gm, str(target.target), None)
    return sub if isinstance(sub, torch.fx.GraphModule) else None


def _planned(gm: torch.fx.GraphModule, n: torch.fx.Node) -> list[torch.fx.Node]:
    """The planned graph's nodes ``n`` stands for: a lowered segment's body, none for a getitem
    of its results (their annotations are copies), else ``n`` itself."""
    body = _segment_body(gm, n)
    if body is not None:
        return [m for m in stage_order(body) if has_info(m)]
    if _is_getitem(n) and isinstance(n.args[0], torch.fx.Node) \
            and _segment_body(gm, n.args[0]) is not None:
        return []
    return [] if is_guard(n) else [n]


def _is_getitem(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def _segment_flops(gm: torch.fx.GraphModule, call: torch.fx.Node) -> int:
    """FLOPs of one run of a lowered segment, from the annotations its nodes carry."""
    target = call.args[0]
    sub = gm.get_submodule(str(target.target)) if isinstance(target, torch.fx.Node) else None
    if not isinstance(sub, torch.fx.GraphModule):
        return info(call).flops
    return sum(info(n).flops for n in stage_order(sub) if has_info(n))


def node_costs(
    gm: torch.fx.GraphModule, plan: Optional[Plan] = None, cost: str = "flops"
) -> list[float]:
    """The cost of each node of :func:`stage_order`: forward work plus recompute work."""
    if cost not in COSTS:
        raise ConfigError(f"cost must be one of {COSTS} (got {cost!r})")
    in_segment = {name for seg in (plan.segments if plan else ()) for name in seg.nodes}
    costs: list[float] = []
    for n in stage_order(gm):
        if _is_getitem(n):
            costs.append(0.0)  # its producer is charged; lowered getitems carry copied annotations
        elif cost == "memory":
            costs.append(float(info(n).new_bytes))
        elif _is_checkpoint_call(n):
            costs.append(2.0 * _segment_flops(gm, n))
        else:
            costs.append(float(info(n).flops) * (2 if n.name in in_segment else 1))
    if not any(costs):
        costs = [1.0] * len(costs)  # nothing measurable: balance node counts
    return costs


def legal_cuts(gm: torch.fx.GraphModule, plan: Optional[Plan] = None) -> list[int]:
    """Positions ``q`` of :func:`stage_order` where a stage may start (see the module docstring).
    """
    order = stage_order(gm)
    pos = {n.name: i for i, n in enumerate(order)}
    illegal: set[int] = set()
    for q, n in enumerate(order):
        if _is_getitem(n) and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in pos:
            illegal.update(range(pos[n.args[0].name] + 1, q + 1))
        for m in info(n).mutates if has_info(n) else ():
            if m in pos and pos[m] < q:
                illegal.update(range(pos[m] + 1, q + 1))
    for seg in plan.segments if plan else ():
        inside = [pos[name] for name in seg.nodes if name in pos]
        if inside:
            illegal.update(range(min(inside) + 1, max(inside) + 1))
    return [q for q in range(1, len(order)) if q not in illegal]


def partition(
    gm: torch.fx.GraphModule,
    stages: Optional[int] = None,
    *,
    balance: Optional[Balance] = None,
    plan: Optional[Plan] = None,
    cost: str = "flops",
) -> StagePlan:
    """Assign every compute node of the annotated ``gm`` to one of ``stages`` contiguous stages.

    ``balance`` overrides the solver: a list of node counts per stage, or a list of the module
    paths where stages 1..K-1 begin (``["layers.2", "layers.4"]`` makes three stages).
    """
    order = stage_order(gm)
    costs = node_costs(gm, plan, cost)
    allowed = legal_cuts(gm, plan)
    try:
        if balance is None:
            if stages is None:
                raise ValueError("give the number of stages (or a balance list)")
            part, method = solver.partition(costs, stages, allowed), "balanced"
        else:
            part, method = _from_balance(order, costs, allowed, balance, stages)
    except ValueError as e:
        raise ConfigError(f"partition: {e}") from e
    return _stage_plan(gm, order, part, method, cost)


def _from_balance(
    order: list[torch.fx.Node],
    costs: list[float],
    allowed: list[int],
    balance: Balance,
    stages: Optional[int],
) -> tuple[solver.Partition, str]:
    counts: object = balance
    method = f"balance={balance!r}"
    if isinstance(balance, (list, tuple)) and balance and all(isinstance(b, str) for b in balance):
        counts = _counts_from_paths(order, [str(b) for b in balance])
        method = f"balance={list(balance)}"
    part = solver.partition_from_balance(costs, counts, allowed)
    if stages is not None and stages != len(part.costs):
        raise ValueError(
            f"balance describes {len(part.costs)} stage(s) but stages={stages}; make them agree"
        )
    return part, method


def _counts_from_paths(order: list[torch.fx.Node], paths: list[str]) -> list[int]:
    """Node counts per stage for stages that begin at the first node of each module path."""
    module_paths = [info(n).module_path if has_info(n) else "" for n in order]
    cuts, start = [], 1
    for p in paths:
        hit = next((q for q in range(start, len(order))
                    if module_paths[q] == p or module_paths[q].startswith(p + ".")), None)
        if hit is None:
            known = sorted({m.split(".")[0] for m in module_paths if m})
            close = difflib.get_close_matches(p, sorted(set(module_paths)), n=3)
            hint = (
                f"; did you mean {', '.join(map(repr, close))}?"
                if close
                else f" (top-level: {known})"
            )
            raise ValueError(
                f"balance boundary {p!r} names no module after position {start - 1} of the "
                f"graph, in order{hint}"
            )
        cuts.append(hit)
        start = hit + 1
    bounds = [0, *cuts, len(order)]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


def _stage_plan(gm: torch.fx.GraphModule, order: list[torch.fx.Node], part: solver.Partition,
                method: str, cost: str) -> StagePlan:
    b = part.bounds
    groups = [order[b[s]:b[s + 1]] for s in range(len(b) - 1)]
    planned = [[m for n in g for m in _planned(gm, n)] for g in groups]
    plan = StagePlan(
        stage_of={n.name: s for s, g in enumerate(groups) for n in g},
        nodes=tuple(tuple(n.name for n in g) for g in groups),
        costs=part.costs,
        module_paths=tuple(_module_paths(p) for p in planned),
        method=method,
        cost=cost,
        planned=tuple(len(p) for p in planned),
    )
    log.info("fxckpt partition: %s", str(plan).splitlines()[0])
    return plan


def _module_paths(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    """The outermost modules a stage's nodes came from (the root's own ops name none)."""
    return outermost(p for n in nodes for p in [info(n).module_path] if p)

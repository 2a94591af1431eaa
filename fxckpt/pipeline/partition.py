"""Partition: cut an annotated graph into K contiguous pipeline stages, then split it.

:func:`partition` is an analysis pass. It costs every compute node from its annotation -- FLOPs,
twice for nodes that are recomputed (inside a checkpoint segment of the Plan, or behind a lowered
``fxckpt.checkpoint`` call) -- and asks :func:`fxckpt.solver.stages.partition` for the cuts
that minimise the slowest stage. A cut is never placed where it would break something:

* between a multi-output op (or a lowered checkpoint call) and its ``getitem`` nodes;
* inside a checkpoint segment of the Plan (when the graph is not lowered yet);
* where a later stage would write in place to a tensor made by an earlier stage (a checkpointed
  stage would see its input changed when it recomputes).

:func:`split_stages` turns the stage assignment into one GraphModule per stage. Stage ``j``
takes every value made before it and used at or after it, and returns every value made at or
before it and used after it, so values that skip stages are passed through automatically:

    stage 0               stage 1                 stage 2
    x --> a --> b ------> c = f(b) ------------>  d = g(c)
          `-- a -------------------- a (carried) --> cat(d, a)     # a U-Net skip

Parameters and buffers are read with ``get_attr`` inside each stage that uses them; the stage
GraphModules hold the same Parameter objects as the graph they came from. Exported graphs
(pytree calling convention) become stages with flat inputs and a flat output;
:func:`pytree_specs` gives the specs to rebuild the caller's structure.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import operator
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.fx

from fxckpt.errors import ConfigError, PlanError
from fxckpt.cost.annotate import has_info, info
from fxckpt.graphs import COMPUTE_OPS, compute_nodes, copy_nodes, is_guard, outermost
from fxckpt.plan import Plan
from fxckpt.runtime.checkpoint import checkpoint as _checkpoint_fn
from fxckpt.runtime.offload import offload_region
from fxckpt.solver import stages as solver

__all__ = ["StagePlan", "partition", "split_stages", "stage_order", "node_costs", "legal_cuts",
           "pytree_specs"]

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


def pytree_specs(gm: torch.fx.GraphModule) -> Optional[tuple[Any, Any]]:
    """``(in_spec, out_spec)`` of an exported graph's calling convention, or ``None``."""
    info_ = getattr(gm.graph._codegen, "pytree_info", None)
    return None if info_ is None else (info_.in_spec, info_.out_spec)


def split_stages(
    gm: torch.fx.GraphModule, stage_of: Mapping[str, int]
) -> list[torch.fx.GraphModule]:
    """One GraphModule per stage; see the module docstring for what each takes and returns."""
    nodes = list(gm.graph.nodes)
    stage = _check_stage_of(nodes, stage_of)
    k = max(stage.values()) + 1
    carried = _carried(nodes, stage, k)
    sizes = [_sizes_read_off(c) for c in carried]
    carried = [[v for v in c if v not in read] for c, read in zip(carried, sizes)]
    out = []
    for j in range(k):
        try:
            out.append(_build_stage(gm, nodes, stage, j, k, carried, sizes[j - 1] if j else {}))
        except Exception as e:
            raise PlanError(f"split_stages: could not build stage {j} of {k}: {e}") from e
    log.debug(
        "split into %d stages; carried between stages: %s",
        k,
        [[n.name for n in c] for c in carried],
    )
    return out


def _check_stage_of(
    nodes: list[torch.fx.Node], stage_of: Mapping[str, int]
) -> dict[torch.fx.Node, int]:
    compute = [n for n in nodes if n.op in COMPUTE_OPS]
    missing = [n.name for n in compute if n.name not in stage_of]
    if missing:
        raise ConfigError(
            f"stage_of must give a stage for every compute node (missing {missing[:5]})"
        )
    stage = {n: stage_of[n.name] for n in compute}
    values = [stage[n] for n in compute]
    if (
        not values
        or values[0] != 0
        or any(b - a not in (0, 1) for a, b in zip(values, values[1:]))
    ):
        raise ConfigError(
            "stages must be contiguous: stage numbers start at 0 and never decrease or skip along "
            f"the topological order (got {values})"
        )
    return stage


def _carried(
    nodes: list[torch.fx.Node], stage: dict[torch.fx.Node, int], k: int
) -> list[list[torch.fx.Node]]:
    """``carried[j]``: values made at or before stage j and used after it (boundary j -> j+1)."""
    carried: list[list[torch.fx.Node]] = [[] for _ in range(k - 1)]
    for n in nodes:
        if n.op in ("get_attr", "output"):
            continue
        made = stage.get(n, 0)  # placeholders are stage 0's inputs
        last = max(
            (stage.get(u, k - 1) for u in n.users), default=made
        )  # the output is built last
        for j in range(made, last):
            carried[j].append(n)
    return carried


def _sizes_read_off(values: list[torch.fx.Node]) -> dict[torch.fx.Node, tuple[torch.fx.Node, int]]:
    """Symbolic sizes among ``values`` that one of the tensors among them has as a dimension.

    An exported graph with dynamic shapes computes ``sym_size`` ints early and uses them late
    (``view(batch, seq, -1)``). Carried across a stage boundary they would be values that are
    not tensors, which ``torch.distributed.pipelining`` cannot send; the next stage reads them
    off a tensor it receives anyway (``node.meta["val"]`` says which dimension is which symbol).
    """
    dims: dict[Any, tuple[torch.fx.Node, int]] = {}
    for t in values:
        val = t.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (t, d))
    read = {}
    for v in values:
        val = v.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr in dims:
            read[v] = dims[val.node.expr]
    return read


def _build_stage(
    gm: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    stage: dict[torch.fx.Node, int],
    j: int,
    k: int,
    carried: list[list[torch.fx.Node]],
    sizes: Mapping[torch.fx.Node, tuple[torch.fx.Node, int]],
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    if j == 0:
        for p in (n for n in nodes if n.op == "placeholder"):
            env[p] = graph.node_copy(p)
    else:
        for v in carried[j - 1]:
            env[v] = graph.placeholder(v.name)
            env[v].meta = dict(v.meta)
        for v, (t, d) in sizes.items():
            env[v] = graph.call_function(torch.ops.aten.sym_size.int, (env[t], d))
            env[v].meta = dict(v.meta)
    last = [next(n for n in reversed(nodes) if n.op == "output")] if j == k - 1 else []
    copy_nodes(graph, [n for n in nodes if stage.get(n) == j] + last, env)
    if j < k - 1:
        graph.output(tuple(env[v] for v in carried[j]))
    graph.lint()
    sgm = torch.fx.GraphModule(gm, graph, class_name=f"Stage{j}")
    sgm.meta["fxckpt_stage"] = {"index": j, "stages": k,
                                "inputs": [n.name for n in graph.nodes if n.op == "placeholder"],
                                "outputs": [v.name for v in carried[j]] if j < k - 1 else None}
    return sgm

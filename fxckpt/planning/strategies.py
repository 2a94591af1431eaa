"""The strategies: each a pass from the annotated graph to its segments (as node runs) and notes.

``every=N`` counts units of work: nodes with FLOPs (matmuls, convolutions, attention). A segment
starts at every N-th unit, moved to the nearest point that does not split a view chain, an
in-place op from its producer, or a multi-output op from its ``getitem``.

``depth=d`` makes one segment of each run of nodes from the same module at nesting depth ``d``.

``budget=`` asks the solver (:mod:`fxckpt.solver`) for the op ranges with the least recompute
whose predicted peak fits, on the networkx/solver view of the graph
(:mod:`fxckpt.cost.bridge`), and which costly outputs inside them to keep rather than
recompute (:mod:`fxckpt.solver.selective`, unless ``selective=False``).

``plan=`` replays a saved plan's segments, found by node name or, in a graph captured elsewhere
(on another device), by their anchors (:mod:`fxckpt.planning.anchors`).

Every pass returns a :class:`Placement` (where segments go: :func:`place`);
:func:`fxckpt.planning.select.select` applies the rules all segments obey
(:mod:`fxckpt.planning.cleanup`) and builds the Plan.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Optional, Sequence

import torch.fx

from fxckpt.budget import Budget
from fxckpt.errors import BudgetInfeasible, PlanError
from fxckpt.planning.anchors import not_in_graph, remap
from fxckpt.cost.annotate import info
from fxckpt.planning.blocks import block_ranges
from fxckpt.planning.cleanup import apply_force, frees_memory, opaque_modules, safe
from fxckpt.planning.fit import Target, infeasible
from fxckpt.planning.keeps import Groups
from fxckpt.planning.peers import peer_starts
from fxckpt.cost.runs import Run, kept_names, to_runs
from fxckpt.plan import Plan, format_bytes
from fxckpt.solver import Problem, simulate
from fxckpt.solver.portfolio import min_peak_plan, solve_plan
from fxckpt.strategy import Budgeted, Depth, Every, Replay, Strategy

__all__ = ["Placement", "place"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What a strategy pass chose."""

    runs: tuple[Run, ...]
    notes: tuple[str, ...] = ()
    budget_bytes: Optional[int] = None
    """The budget in bytes the runs were solved (or replayed) for."""
    why_none: Optional[str] = None
    """Why there are no runs, when the pass knows better than "it found none"."""
    keeps: tuple[str, ...] = ()
    """Nodes inside the runs whose outputs are kept from forward (selective recompute)."""


def place(strategy: Optional[Strategy], order: Sequence[torch.fx.Node], problem: Problem,
           force: dict[str, str], target: Target = Target(),
           keepable: tuple[Groups, Groups] = ([], [])) -> Placement:
    """Run the pass of ``strategy`` (``None``: only ``force`` pins) over the compute nodes
    ``order``. ``keepable`` = the groups a budget plan may keep and must keep
    (:func:`fxckpt.planning.keeps.choices`); ``force`` holds module pins only."""
    if isinstance(strategy, Every):
        runs, notes = every(order, strategy.units)
        return _cleaned(order, runs, force, notes)
    if isinstance(strategy, Depth):
        runs = depth(order, strategy.depth)
        placement = _cleaned(order, runs, force)
        hidden = [f"{p} ({cls})" for p, cls in opaque_modules(order)
                  if len(p.split(".")) < strategy.depth]
        if runs or not hidden:
            return placement
        return dataclasses.replace(placement, why_none=(
            f"nothing is checkpointed: no module at depth {strategy.depth} is in the captured "
            f"graph; {', '.join(hidden)} run(s) as one op each, so what is inside is not in it "
            "(keep the model's own modules traceable, or choose a smaller depth)"))
    if isinstance(strategy, Budgeted):
        solved, limit, keeps, notes = budgeted(problem, order, strategy.budget, target,
                                               keepable)
        # The solver's segments all pay off by its own account: only the correctness rules here.
        return Placement(
            tuple(r for r in map(safe, apply_force(order, solved, force)) if r),
            budget_bytes=limit, keeps=keeps, notes=notes,
        )
    if isinstance(strategy, Replay):
        runs, names = replayed(order, strategy.plan)
        return Placement(tuple(runs), budget_bytes=strategy.plan.budget_bytes, keeps=tuple(names))
    return _cleaned(order, [], force)


def _cleaned(order: Sequence[torch.fx.Node], runs: list[Run], force: dict[str, str],
             notes: tuple[str, ...] = ()) -> Placement:
    """The candidate runs checkpoint can recompute, without those that would free nothing."""
    candidates = [r for r in map(safe, apply_force(order, runs, force)) if r]
    kept = tuple(r for r in candidates if frees_memory(r))
    if kept or not candidates or not runs:  # force pins alone explain themselves (force_notes)
        return Placement(kept, notes)
    return Placement(kept, notes, why_none=(
        f"nothing is checkpointed: each of the {len(candidates)} candidate segment(s) keeps what "
        "it would free (every tensor it makes is used after it, as with one layer of a flat "
        "nn.Sequential); group several layers per segment with every=N or budget="))


def every(
    order: Sequence[torch.fx.Node], units_per_segment: int
) -> tuple[list[Run], tuple[str, ...]]:
    """Runs of ``units_per_segment`` units of work, cut at legal points."""
    notes = []
    units = [i for i, n in enumerate(order) if info(n).flops > 0]
    if not units:
        units = [i for i, n in enumerate(order) if info(n).new_bytes > 0]
        notes.append("no node has FLOPs; every= counts nodes that allocate memory instead")
    if len(units) <= units_per_segment:
        notes.append(
            f"every={units_per_segment} but the graph has {len(units)} unit(s) of work: one "
            "segment"
        )
    wanted = [units[k] for k in range(units_per_segment, len(units), units_per_segment)]
    cuts = [0]
    for k, p in enumerate(wanted):
        hi = wanted[k + 1] if k + 1 < len(wanted) else len(order)
        cut = _nearest_legal_cut(order, p, lo=cuts[-1] + 1, hi=hi)
        if cut is None:
            notes.append(f"no legal cut near {order[p].name}; merged two segments")
        elif cut != p:
            log.debug("every: moved cut from %s to %s", order[p].name, order[cut].name)
        if cut is not None:
            cuts.append(cut)
    cuts.append(len(order))
    return [list(order[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a], tuple(notes)


def _nearest_legal_cut(order: Sequence[torch.fx.Node], p: int, lo: int, hi: int) -> Optional[int]:
    for d in range(0, max(p - lo, hi - p) + 1):
        for q in (p - d, p + d):
            if lo <= q < hi and _legal_cut(order, q):
                return q
    return None


def _legal_cut(order: Sequence[torch.fx.Node], q: int) -> bool:
    """May a segment start at ``order[q]``? Not inside a view chain, in-place op or getitem."""
    node, before = order[q], {n.name for n in order[:q]}
    if node.op == "call_function" and node.target is operator.getitem:
        return False
    i = info(node)
    return not (set(i.aliases) & before or set(i.mutates) & before)


def depth(order: Sequence[torch.fx.Node], level: int) -> list[Run]:
    """One run per stretch of nodes from the same module at nesting depth ``level``."""
    runs: list[Run] = []
    current: Optional[str] = None
    for n in order:
        parts = info(n).module_path.split(".") if info(n).module_path else []
        prefix = ".".join(parts[:level]) if len(parts) >= level else None
        if prefix is not None and prefix == current:
            runs[-1].append(n)
        elif prefix is not None:
            runs.append([n])
        current = prefix
    return runs


def budgeted(
    problem: Problem, order: Sequence[torch.fx.Node], budget: Budget, target: Target = Target(),
    keepable: tuple[Groups, Groups] = ([], []),
) -> tuple[list[Run], int, tuple[str, ...], tuple[str, ...]]:
    """Runs with the least recompute whose predicted peak fits ``budget`` (where ``target``
    aims: :class:`~fxckpt.planning.fit.Target`); the budget in bytes; the nodes kept inside the
    runs, chosen among ``keepable`` (:mod:`fxckpt.solver.selective`); the solver's notes (a
    heuristic's bound)."""
    simulated = simulate(problem, ()).peak_bytes
    aside = target.set_aside(simulated)  # what verification found every plan holds besides
    eager, limit = target.eager(simulated), target.limit(budget, simulated)
    blocks = block_ranges(problem, order)
    offered, forced = keepable
    starts = peer_starts(problem, order, blocks, [*offered, *forced])
    if target.minimum:
        least = tuple(blocks) if target.per_block else min_peak_plan(problem, blocks, starts)[0]
        return to_runs(problem, least, order), limit, (), ()
    if target.eager_bytes is not None and target.eager_bytes <= limit:  # the first candidate
        return [], limit, (), (f"the unmodified step (verified {format_bytes(eager)}) fits the "
                               "budget: nothing is recomputed",)
    aim = target.aim(limit, simulated)
    if aim <= 0:
        raise infeasible(limit, min_peak_plan(problem, blocks, starts)[1] + aside, eager,
                         asked=str(budget))
    try:
        solution = solve_plan(problem, aim, blocks, offered, forced, starts)
    except BudgetInfeasible as e:
        raise infeasible(limit, e.min_budget + aside, eager, asked=str(budget)) from e
    log.info(
        "budget %s (%s): %d segment(s), %d kept op(s), predicted peak %s, recompute cost %.3g",
        budget,
        format_bytes(limit),
        len(solution.segments),
        len(solution.keep),
        format_bytes(solution.predicted_peak),
        solution.recompute_cost,
    )
    runs = to_runs(problem, solution.segments, order)
    notes: tuple[str, ...] = ()
    if solution.bound:
        notes = (solution.bound.note(solution.recompute_cost),)
    if solution.origin:
        notes += (f"solver: fitted from the {solution.origin} plan, the cheapest found for "
                  "this budget",)
    return runs, limit, kept_names(problem, solution.keep), notes


def replayed(order: Sequence[torch.fx.Node], plan: Plan) -> tuple[list[Run], list[str]]:
    """The saved plan's segments on this graph, and the nodes they keep: by node name when this
    graph has every node the plan names, as contiguous runs; otherwise by the segments' anchors
    (:mod:`fxckpt.planning.anchors`), as when a plan made on the ``meta`` device is replayed on the
    device the model was materialised on.
    """
    position = {n.name: i for i, n in enumerate(order)}
    names = all(name in position for seg in plan.segments for name in seg.nodes)
    anchored = not names and bool(plan.segments) and all(seg.anchors for seg in plan.segments)
    if anchored:
        try:
            return remap(order, [(seg.name, seg.anchors) for seg in plan.segments])
        except PlanError as e:
            log.debug("replay by anchors failed: %s", e)
    nor = " (nor the module and op its anchors name)" if anchored else ""
    runs = []
    for seg in plan.segments:
        missing = [name for name in seg.nodes if name not in position]
        if missing:
            raise not_in_graph(seg.name, f"names node {missing[0]!r}", nor=nor,
                               signature=str(plan.signature))
        idx = [position[name] for name in seg.nodes]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise PlanError(
                f"the saved plan's {seg.name} is not a contiguous run of this graph's nodes"
            )
        runs.append([order[i] for i in idx])
    return runs, [name for seg in plan.segments for name in seg.keeps]

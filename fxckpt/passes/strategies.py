"""Select: the strategies that choose recompute segments, producing a :class:`~fxckpt.plan.Plan`.

A segment is a contiguous run of compute nodes in topological order. Every strategy produces
runs; the same clean-up then applies to all of them:

* ``force`` pins win: ``"save"`` nodes leave their segments, ``"recompute"`` nodes form their own.
* a segment never writes in place to a tensor it did not create (a segment input mutated by the
  first run would be seen mutated by the recompute), so it starts after its last such write;
* a segment that frees nothing (every tensor it makes is read outside it) is dropped: it would
  cost a recompute and save no memory.

``every=N`` counts units of work: nodes with FLOPs (matmuls, convolutions, attention). A segment
starts at every N-th unit, moved to the nearest point that does not split a view chain, an
in-place op from its producer, or a multi-output op from its ``getitem``.

``depth=d`` makes one segment of each run of nodes from the same module at nesting depth ``d``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Mapping, Sequence

import torch.fx

from fxckpt.config import TransformConfig
from fxckpt.errors import PlanError
from fxckpt.passes.annotate import info, planned_nodes
from fxckpt.passes.budget import (choose_actions, device_of, offload_cost_per_byte, predict,
                                  solve_runs)
from fxckpt.passes.graph_view import problem_of
from fxckpt.plan import Plan, Segment

__all__ = ["select", "segment_runs"]

log = logging.getLogger(__name__)

Run = list[torch.fx.Node]


def select(
    gm: torch.fx.GraphModule, config: TransformConfig, *, capture: str, training: bool, signature: str,
    keep: Mapping[str, str] = {},
) -> Plan:
    """Choose segments for the annotated ``gm`` as ``config`` asks.

    ``keep`` maps nodes that must never be recomputed (calls of modules with hooks, which would
    fire again) to their module paths; they are taken out of every segment.
    """
    order = planned_nodes(gm.graph)
    notes: list[str] = []
    problem = problem_of(gm)
    if config.offload == "auto" and config.replay is None:
        per_byte = offload_cost_per_byte(config.offload_bandwidth, device_of(gm),
                                         config.offload_device or "cpu")
        problem = dataclasses.replace(problem, offload_cost_per_byte=per_byte)
    limit = None
    if config.replay is not None:
        runs = _replayed(order, config.replay)
    elif config.budget is not None:
        solved, limit = solve_runs(problem, order, config.budget)
        # The solver's segments all pay off by its own account: only correctness clean-up here.
        runs = [r for r in map(_safe, _apply_force(order, solved, config.force)) if r]
    else:
        runs = segment_runs(order, config, notes)
    runs = _without_kept(order, runs, keep, notes)
    _explain_force(order, runs, config.force, notes)
    prediction = predict(problem, runs)
    if limit is not None and prediction.peak > limit:
        notes.append(f"clean-up moved segments; predicted peak {prediction.peak} B is over the budget {limit} B")
    prefix = _segment_prefix(gm, len(runs))
    segments = tuple(_describe(f"{prefix}_{i}", run, config) for i, run in enumerate(runs))
    if config.offload == "auto" and config.replay is None:
        segments = choose_actions(problem, segments, runs, notes)
    elif config.replay is not None:
        actions = [s.action for s in config.replay.segments]
        segments = tuple(dataclasses.replace(s, action=a) for s, a in zip(segments, actions))
        limit = config.replay.budget
    if not segments:
        notes.append(
            "nothing is checkpointed: no strategy was given"
            if config.strategy == "none" else "nothing is checkpointed: the strategy found no segment"
        )
    plan = Plan(
        strategy=config.strategy, options=config.to_dict(), capture=capture, training=training,
        signature=signature, segments=segments, node_count=len(order),
        total_flops=sum(info(n).flops for n in order), notes=tuple(notes),
        eager_peak=prediction.eager_peak, predicted_peak=prediction.peak,
        predicted_recompute=prediction.recompute, budget=limit,
    )
    log.info("fxckpt plan: %s", plan.summary())
    for seg in segments:
        log.info("  %s: %s (%d nodes, %s)", seg.name, ", ".join(seg.module_paths) or "-", len(seg.nodes), seg.reason)
    return plan


def _segment_prefix(gm: torch.fx.GraphModule, count: int) -> str:
    """``segment``, or a longer prefix if the graph module already has ``segment_<i>`` attributes."""
    prefix = "segment"
    while any(hasattr(gm, f"{prefix}_{i}") for i in range(count)):
        prefix = "fxckpt_" + prefix
    return prefix


def segment_runs(order: Sequence[torch.fx.Node], config: TransformConfig, notes: list[str]) -> list[Run]:
    """The segments, as node runs, for ``config`` over the compute nodes ``order``."""
    if config.every is not None:
        runs = _every(order, config.every, notes)
    elif config.depth is not None:
        runs = _depth(order, config.depth)
    else:
        runs = []
    return _clean(order, runs, config)


def _clean(order: Sequence[torch.fx.Node], runs: list[Run], config: TransformConfig) -> list[Run]:
    runs = _apply_force(order, runs, config.force)
    return [r for r in map(_safe, runs) if _frees_memory(r)]


def _replayed(order: Sequence[torch.fx.Node], plan: Plan) -> list[Run]:
    """The saved plan's segments on this graph; every node must exist and runs must be contiguous."""
    position = {n.name: i for i, n in enumerate(order)}
    runs = []
    for seg in plan.segments:
        missing = [name for name in seg.nodes if name not in position]
        if missing:
            raise PlanError(
                f"the saved plan's {seg.name} names node {missing[0]!r}, which this model's graph does not "
                f"have; was the plan made for another model, mode or input signature ({plan.signature})?"
            )
        idx = [position[name] for name in seg.nodes]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise PlanError(f"the saved plan's {seg.name} is not a contiguous run of this graph's nodes")
        runs.append([order[i] for i in idx])
    return runs


def _every(order: Sequence[torch.fx.Node], every: int, notes: list[str]) -> list[Run]:
    units = [i for i, n in enumerate(order) if info(n).flops > 0]
    if not units:
        units = [i for i, n in enumerate(order) if info(n).new_bytes > 0]
        notes.append("no node has FLOPs; every= counts nodes that allocate memory instead")
    if len(units) <= every:
        notes.append(f"every={every} but the graph has {len(units)} unit(s) of work: one segment")
    wanted = [units[k] for k in range(every, len(units), every)]
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
    return [list(order[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]


def _nearest_legal_cut(order: Sequence[torch.fx.Node], p: int, lo: int, hi: int) -> int | None:
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


def _depth(order: Sequence[torch.fx.Node], depth: int) -> list[Run]:
    runs: list[Run] = []
    current: str | None = None
    for n in order:
        parts = info(n).module_path.split(".") if info(n).module_path else []
        prefix = ".".join(parts[:depth]) if len(parts) >= depth else None
        if prefix is not None and prefix == current:
            runs[-1].append(n)
        elif prefix is not None:
            runs.append([n])
        current = prefix
    return runs


def _pinned(n: torch.fx.Node, force: Mapping[str, str]) -> str | None:
    path = info(n).module_path
    best = None
    for p, mode in force.items():
        if (path == p or path.startswith(p + ".")) and (best is None or len(p) > len(best[0])):
            best = (p, mode)
    return best[1] if best else None


def _apply_force(order: Sequence[torch.fx.Node], runs: list[Run], force: Mapping[str, str]) -> list[Run]:
    if not force:
        return runs
    free = [[n for n in r if _pinned(n, force) is None] for r in runs]
    split = [piece for r in free for piece in _contiguous(r, order)]
    forced = _contiguous([n for n in order if _pinned(n, force) == "recompute"], order)
    pos = {n: i for i, n in enumerate(order)}
    return sorted((r for r in split + forced if r), key=lambda r: pos[r[0]])


def _contiguous(nodes: list[torch.fx.Node], order: Sequence[torch.fx.Node]) -> list[Run]:
    pos = {n: i for i, n in enumerate(order)}
    runs: list[Run] = []
    for n in nodes:
        if runs and pos[n] == pos[runs[-1][-1]] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _safe(run: Run) -> Run:
    """The part of ``run`` that checkpoint can recompute: see :func:`_safe_suffix` and
    :func:`_unwritten_prefix`."""
    return _unwritten_prefix(_safe_suffix(run)) if run else run


def _unwritten_prefix(run: Run) -> Run:
    """Cut a run before the first node whose tensors a later node writes in place.

    Checkpoint keeps a segment's inputs and checks their version counters when it recomputes,
    and matches its outputs to the recomputed ones: an input or output written in place after
    the segment (OLMo's ``query_states.clamp_()``) would fail those checks in backward.
    """
    if not run:
        return run
    members = set(run)
    order = list(run[0].graph.nodes)
    later = order[order.index(run[-1]) + 1:]
    written = {m for n in later if "fxckpt" in n.meta for m in info(n).mutates}
    if not written:
        return run
    for i, n in enumerate(run):
        read = [a for a in n.all_input_nodes if a not in members and _storage_of(a) in written]
        if read or _storage_of(n) in written:
            log.debug("segment starting at %s: %s is written in place after it; ends before %s",
                      run[0].name, (read[0] if read else n).name, n.name)
            return run[:i]
    return run


def _storage_of(node: torch.fx.Node) -> str:
    """The node owning the storage ``node``'s output lives in (itself unless it is a view)."""
    if "fxckpt" not in node.meta:
        return node.name
    i = info(node)
    return i.aliases[0] if i.aliases and i.new_bytes == 0 else node.name


def _safe_suffix(run: Run) -> Run:
    """Drop the head of a run up to its last in-place write to a tensor from outside it.

    Dropping a head can turn a write inside the run into one to an outside tensor (``clamp_``
    of a ``linear`` just dropped), so this repeats until no such write is left.
    """
    graph_nodes = {n.name: n for n in run[0].graph.nodes} if run else {}
    while run:
        names = {n.name for n in run}
        last = -1
        for i, n in enumerate(run):
            if any(m not in names and graph_nodes[m].op != "get_attr" for m in info(n).mutates):
                last = i
        if last < 0:
            return run
        log.debug("segment starting at %s writes to its input in %s; starts after it",
                  run[0].name, run[last].name)
        run = run[last + 1:]
    return run


def _frees_memory(run: Run) -> bool:
    """Would recomputing ``run`` free anything: a tensor used only inside it, or a leaf module's
    insides (what autograd keeps within ``nn.TransformerEncoderLayer`` and the like)?"""
    members = set(run)
    return any((info(n).new_bytes > 0 and all(u in members for u in n.users)) or info(n).saves_internal_bytes > 0
               for n in run)


def _without_kept(order: Sequence[torch.fx.Node], runs: list[Run], keep: Mapping[str, str],
                  notes: list[str]) -> list[Run]:
    """Take the ``keep`` nodes out of every run; say which modules that affected and why."""
    if not keep:
        return runs
    hit = sorted({keep[n.name] for r in runs for n in r if n.name in keep})
    for path in hit:
        notes.append(f"{path} has hooks: it runs as it is, outside recompute segments, so its hooks fire "
                     "once per forward")
    pieces = [piece for r in runs for piece in _contiguous([n for n in r if n.name not in keep], order)]
    return [p for p in pieces if p and _frees_memory(p)]


def _explain_force(order: Sequence[torch.fx.Node], runs: list[Run], force: Mapping[str, str],
                   notes: list[str]) -> None:
    """Never drop a ``force`` pin silently: say why a module forced to recompute is not a segment."""
    in_runs = {n for r in runs for n in r}
    for path, mode in force.items():
        if mode != "recompute":
            continue
        nodes = [n for n in order if _pinned(n, force) == "recompute" and _under(info(n).module_path, path)]
        if not nodes:
            notes.append(f"force[{path!r}] = 'recompute' has no effect: no compute node of the captured "
                         "graph comes from that module (is it called in forward?)")
        elif not any(n in in_runs for n in nodes):
            notes.append(f"force[{path!r}] = 'recompute' has no effect: recomputing it would free nothing "
                         "(every tensor it makes is used after it), or it has hooks")


def _under(module_path: str, path: str) -> bool:
    return module_path == path or module_path.startswith(path + ".")


def _describe(name: str, run: Run, config: TransformConfig) -> Segment:
    members = set(run)
    inputs: list[torch.fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in inputs:
                inputs.append(a)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    return Segment(
        name=name,
        nodes=tuple(n.name for n in run),
        module_paths=_outermost(info(n).module_path for n in run),
        inputs=tuple(a.name for a in inputs),
        outputs=tuple(n.name for n in outputs),
        saved_bytes=sum(info(a).nbytes for a in inputs if a.meta.get("fxckpt") and not info(a).is_state),
        freed_bytes=sum(info(n).new_bytes for n in run if n not in outputs),
        recompute_flops=sum(info(n).flops for n in run),
        restores=tuple(sorted({b for n in run for b in info(n).writes_buffers})),
        reason=_reason(run, config),
    )


def _outermost(paths) -> tuple[str, ...]:
    unique = sorted({p or "<root>" for p in paths}, key=lambda p: (p.count("."), p))
    kept: list[str] = []
    for p in unique:
        if not any(p == k or p.startswith(k + ".") for k in kept):
            kept.append(p)
    return tuple(kept)


def _reason(run: Run, config: TransformConfig) -> str:
    pin = _pinned(run[0], dict(config.force)) if config.force else None
    if pin == "recompute":
        return "force: recompute"
    if config.every is not None:
        return f"every={config.every}"
    if config.depth is not None:
        return f"depth={config.depth}"
    if config.budget is not None:
        return "budget: least recompute under the peak"
    if config.replay is not None:
        return "replayed from a saved plan"
    return "force"

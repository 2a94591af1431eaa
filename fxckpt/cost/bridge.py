"""The one bridge from ``torch.fx`` to plain data: a networkx view and the solver's Problem.

The solvers never see fx. This module reads the annotated graph (``node.meta[META_KEY]``) once
and produces

* ``to_networkx(gm)``: a ``networkx.DiGraph`` of compute nodes and graph inputs, with edges for
  data flow and node attributes for bytes, cost, saved tensors and module path;
* ``to_problem(graph)``: the solver's :class:`~fxckpt.solver.problem.Problem`, one ``Op`` per
  compute node in the fx order (a topological order).

Two modelling choices live here:

* **cost** of an op is in FLOP-equivalents: on the CPU its FLOPs (matmuls, convolutions,
  attention) plus the price of the aten calls it runs: a fixed price per call and the bytes each
  memory-bound call writes at its op's price (:mod:`fxckpt.cost.prices`: on this project's CPU
  a ``mul`` costs 3 FLOP-equivalents per byte, ``tanh`` 62, dropout's Bernoulli draw 140).
  Recomputing memory-bound ops is far from free, and the solver must know which ones. With a
  device profile (a GPU's), its roofline time in FLOP-equivalents at that device's bf16 rate,
  and segments and kept nodes cost the profile's overheads (:mod:`fxckpt.cost.devices`);
* tensors autograd keeps that no node outputs (dropout masks, a leaf module's insides) become a
  synthetic op ``<node>::saved`` just before the node, read and saved only by it;
* the step's loss is outside the graph, but its memory is part of the step: a synthetic last op
  ``loss::assumed`` keeps one tensor as large as the model's floating outputs, as cross-entropy
  keeps its log-softmax and a squared error its difference, and its backward makes their gradients.
  With the user's ``loss_fn``, what that loss was measured holding instead
  (:func:`fxckpt.measure.loss_probe.fake_loss_peak`): ``logits.float().square().mean()`` holds five
  times the logits in its backward, and a plan that keeps much until the loss peaks there.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import networkx as nx
import torch.fx

from fxckpt.cost import refined
from fxckpt.cost.annotate import NodeInfo, has_info, info
from fxckpt.capture.graphs import planned_nodes
from fxckpt.cost.devices import DeviceProfile, offload_price, profile_for
from fxckpt.cost.prices import KEEP_COST, SAVED_COST, SEGMENT_COST
from fxckpt.cost.rates import device_of
from fxckpt.solver.problem import Op, Problem

__all__ = ["to_networkx", "to_problem", "problem_of", "SYNTHETIC", "LOSS", "SEGMENT_COST",
           "SAVED_COST", "KEEP_COST"]

SYNTHETIC = "::saved"
LOSS = "loss::assumed"


def to_networkx(gm: torch.fx.GraphModule,
                profile: Optional[DeviceProfile] = None) -> nx.DiGraph:
    """Compute nodes (in fx order) and graph inputs, with data-flow edges and cost attributes
    (priced for ``profile``'s device; ``None``: the CPU price table)."""
    graph = nx.DiGraph()
    order = planned_nodes(gm.graph)
    members = set(order)
    nodes = {n.name: n for n in gm.graph.nodes}
    factor = refined.scale()  # a training step's measured factor, when the plan is refined
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            graph.add_node(n.name, kind="input", out_bytes=0, cost=0.0, saves=(), internal=0)
    for position, n in enumerate(order):
        i = info(n)
        graph.add_node(
            n.name, kind="op", position=position, out_bytes=i.new_bytes,
            cost=_cost(i, profile) * factor, saves=tuple(_root(nodes, s) for s in i.saves),
            internal=i.saves_internal_bytes, grad=i.new_bytes if _floating(i.dtypes) else 0,
            module_path=i.module_path, scratch=i.scratch, saved_count=i.saved_count,
        )
        for a in n.all_input_nodes:
            root = _root(
                nodes, a.name
            )  # a view of a parameter or buffer has a get_attr root: not an edge
            if (a in members or a.op == "placeholder") and root in graph:
                graph.add_edge(root, n.name)
    graph.graph["outputs"] = tuple(
        dict.fromkeys(
            _root(nodes, a.name)
            for n in gm.graph.nodes
            if n.op == "output"
            for a in n.all_input_nodes
            if a in members
        )
    )
    return graph


def _cost(i: NodeInfo, profile: Optional[DeviceProfile] = None) -> float:
    if profile is None:
        return float(i.flops + i.work)
    if profile.table is not None:
        return float(i.flops + profile.table.work(i.priced))
    return profile.cost(i.flops, i.moved, len(i.calls), i.dtypes[0] if i.dtypes else None)


def _floating(dtypes: tuple[str, ...]) -> bool:
    return any(d.startswith(("float", "bfloat", "complex")) for d in dtypes)


def _root(nodes: dict[str, torch.fx.Node], name: str) -> str:
    """The node owning the storage of ``name``'s output (itself unless it is a view/alias)."""
    node = nodes.get(name)
    if node is None or not has_info(node):
        return name
    aliases = info(node).aliases
    return aliases[0] if aliases and info(node).new_bytes == 0 else name


def to_problem(graph: nx.DiGraph, profile: Optional[DeviceProfile] = None,
               loss_bytes: Optional[int] = None) -> Problem:
    """The solver's Problem from a :func:`to_networkx` view (overheads for ``profile``).

    ``loss_bytes``: the peak the step's loss adds, the outputs it keeps and their gradients
    included (:func:`fxckpt.measure.loss_probe.fake_loss_peak`); ``None``: one tensor as large as
    the outputs, and their gradients.
    """
    ops: list[Op] = []
    ops_in_order = sorted((n for n, d in graph.nodes(data=True) if d["kind"] == "op"),
                          key=lambda n: graph.nodes[n]["position"])
    for name in ops_in_order:
        d = graph.nodes[name]
        saves = tuple(s for s in d["saves"] if s in graph)
        if d["internal"]:
            ops.append(Op(name=name + SYNTHETIC, out_bytes=d["internal"], cost=0.0, grad_bytes=0,
                          hidden=True))
            saves = saves + (name + SYNTHETIC,)
        inputs = tuple(dict.fromkeys(p for p in graph.predecessors(name) if p != name))
        ops.append(Op(name=name, out_bytes=d["out_bytes"], cost=d["cost"], inputs=inputs,
                      saves=tuple(dict.fromkeys(saves)), grad_bytes=d["grad"],
                      scratch_bytes=d.get("scratch", 0), saved_tensors=d.get("saved_count", 0)))
    outputs = tuple(
        o for o in graph.graph["outputs"] if graph.nodes.get(o, {}).get("kind") == "op"
    )
    grads = sum(graph.nodes[o]["grad"] for o in outputs)
    # The loss op's backward makes the outputs' gradients: it holds the rest itself. Without a
    # measured loss, one tensor as large as the outputs (what verification finds beyond it, as
    # for the stand-in loss of fxckpt.measure.verify, is set aside by fxckpt.planning.fit).
    # Every peak includes a reserve for what the simulator does not model (backward
    # temporaries, kernel scratch): the largest single gradient or scratch buffer. A measured
    # loss holds its own temporaries: less the reserve, so that its peak is not counted twice.
    reserve = max((max(op.gradient_bytes, op.scratch_bytes) for op in ops), default=0)
    held = grads if loss_bytes is None else max(0, loss_bytes - grads - reserve)
    ops.append(
        Op(name=LOSS, out_bytes=held, cost=0.0, inputs=outputs, saves=(LOSS,), grad_bytes=0)
    )
    segment, keep, saved = SEGMENT_COST, KEEP_COST, SAVED_COST
    if profile is not None:
        segment, keep, saved = (profile.segment * profile.unit, profile.keep * profile.unit,
                                profile.saved * profile.unit)
    return Problem(ops=tuple(ops), outputs=(LOSS,), segment_overhead=segment,
                   keep_overhead=keep, saved_overhead=saved, early_stop=True,
                   reserve_bytes=reserve)


def problem_of(gm: torch.fx.GraphModule, profile: Optional[DeviceProfile] = None,
               loss_bytes: Optional[int] = None) -> Problem:
    """``to_problem(to_networkx(gm, profile), profile, loss_bytes)``."""
    return to_problem(to_networkx(gm, profile), profile, loss_bytes)


def priced_problem(gm: torch.fx.GraphModule, device_profile: Optional[str] = None,
                   loss_bytes: Optional[int] = None, *, offload: bool = False,
                   bandwidth: Optional[float] = None, host: str = "cpu") -> Problem:
    """The annotated ``gm`` as the solver's problem, priced for the device it plans for: the
    profile ``device_profile`` names (``None``: the device's own, see
    :func:`~fxckpt.cost.devices.profile_for`), and with ``offload`` the price of a byte moved
    to ``host`` and back at ``bandwidth`` (:func:`~fxckpt.cost.devices.offload_price`)."""
    profile = profile_for(device_profile, device_of(gm))
    problem = problem_of(gm, profile, loss_bytes)
    if not offload:
        return problem
    per_byte = offload_price(profile, bandwidth, device_of(gm), host)
    return dataclasses.replace(problem, offload_cost_per_byte=per_byte)

"""Lower: rewrite each planned segment into a submodule called through the runtime checkpoint.

    before                                   after
    ------                                   -----
    fc = self.layers.0.fc(x)                 segment_0 = self.segment_0
    relu = torch.relu(fc)           ==>      relu = fxckpt_checkpoint(segment_0, x)
    ...                                      ...

Parameters and buffers are read inside the segment that uses them (a ``get_attr`` is copied into
every segment that needs it), so checkpoint's inputs are only activations. The segment
submodules share the model's Parameter and buffer objects.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx

from fxckpt.errors import PlanError
from fxckpt.capture.graphs import subgraph
from fxckpt.plan import Plan, SegmentSpec
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.offload import offload_region
from fxckpt.cost.annotate import has_info, info
from fxckpt.runtime.segment import NO_EARLY_STOP, Offloading, SegmentModule
from fxckpt.runtime.selective import keep_begin, keep_end

__all__ = ["lower"]

log = logging.getLogger(__name__)


def lower(gm: torch.fx.GraphModule, plan: Plan,
          offloader: Optional[Offloading] = None) -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place so every segment of ``plan`` runs under checkpoint; returns ``gm``.

    Segments the plan offloads (``action="offload"``) run under ``offloader``'s saved-tensor
    hooks instead (the transformed module's :class:`~fxckpt.runtime.offload.Offloader`; without
    one they keep what they save, as an unmodified step does).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    _placeholders_first(gm.graph)
    for seg in plan.segments:
        try:
            _lower_segment(gm, seg, nodes, plan.training, offloader)
        except KeyError as e:
            raise PlanError(
                f"lower: {seg.name} names node {e}, which the graph does not have"
            ) from e
        except Exception as e:
            raise PlanError(
                f"lower: could not rewrite {seg.name} ({seg.nodes[0]}..{seg.nodes[-1]}): {e}"
            ) from e
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm


def _placeholders_first(graph: torch.fx.Graph) -> None:
    """Move placeholders (in their order) before all other nodes, so any input is defined early."""
    anchor = None
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        first = next(iter(graph.nodes))
        if anchor is None:
            if first is not p:
                first.prepend(p)
        else:
            anchor.append(p)
        anchor = p


def _lower_segment(
    gm: torch.fx.GraphModule, seg: SegmentSpec, nodes: dict[str, torch.fx.Node], training: bool,
    offloader: Optional[Offloading] = None,
) -> None:
    members = [nodes[name] for name in seg.nodes]
    member_set = set(members)
    inputs = [nodes[name] for name in seg.inputs]
    outputs = [nodes[name] for name in seg.outputs]
    body = _extract(gm, members, inputs, outputs, seg.keeps)
    sub = SegmentModule(body, body.graph, name=seg.name, restores=seg.restores,
                        kept=len(seg.keeps), generators=_generators(body),
                        early_stop=not any(op in NO_EARLY_STOP for n in members if has_info(n)
                                           for op in info(n).ops),
                        draws=any(not has_info(n) or info(n).random for n in members),
                        offloader=offloader if seg.action == "offload" else None,
                        forward_cost=seg.forward_cost, compiled_keeps=seg.compiled_keeps)
    sub.training = training  # not .train(): that would also flip the model's own submodules
    gm.add_submodule(seg.name, sub)

    graph = gm.graph
    with graph.inserting_before(members[0]):
        fn = graph.get_attr(seg.name)
        runner = offload_region if seg.action == "offload" else checkpoint
        call = graph.call_function(runner, (fn, *inputs))
        if len(outputs) == 1:
            results = [call]
        else:
            results = [
                graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))
            ]
    for old, new in zip(outputs, results):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in member_set)
    for n in reversed(members):
        graph.erase_node(n)
    if len(outputs) == 1:
        # the code reads `relu = fxckpt_checkpoint(segment_0, x)`. The erased node keeps its name
        # reserved in the graph's namespace (so `_rename` would give `relu_1`); it is gone from
        # the graph, so the call may take the name itself, and no later node can be given it.
        call.name = seg.outputs[0]
    for name, new in zip(seg.outputs, results):
        nodes[name] = new  # later segments name their inputs as the plan saw them
    log.debug(
        "lowered %s: %d nodes, inputs %s, outputs %s",
        seg.name,
        len(members),
        seg.inputs,
        seg.outputs,
    )


def _generators(body: torch.fx.GraphModule) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects the segment's code draws from (constants of the graph)."""
    found: dict[int, torch.Generator] = {}
    for n in body.graph.nodes:
        if n.op == "get_attr":
            value = body
            for part in str(n.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Generator):
                found[id(value)] = value
    return tuple(found.values())


def _bracket(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> None:
    """``keep_begin(i)``; the node; ``node = keep_end(i, node)`` for every later use."""
    with graph.inserting_before(node):
        graph.call_function(keep_begin, (index,))
    with graph.inserting_after(node):
        end = graph.call_function(keep_end, (index, node))
    end.meta = dict(node.meta)
    node.replace_all_uses_with(end, delete_user_cb=lambda user: user is not end)


def _extract(
    gm: torch.fx.GraphModule,
    members: list[torch.fx.Node],
    inputs: list[torch.fx.Node],
    outputs: list[torch.fx.Node],
    keeps: tuple[str, ...] = (),
) -> torch.fx.GraphModule:
    """A GraphModule computing ``outputs`` of ``members`` from ``inputs``, sharing ``gm``'s state;
    each node named in ``keeps`` bracketed by the runtime's keep calls (selective recompute)."""
    graph, env = subgraph(members, inputs)
    for index, name in enumerate(keeps):
        _bracket(graph, next(env[m] for m in members if m.name == name), index)
    result = tuple(env[o] for o in outputs)
    graph.output(result[0] if len(result) == 1 else result)
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name="SegmentSpec")

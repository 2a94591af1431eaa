"""Flatten: the lowered graph with every segment inlined again, for inspection.

Pictures and the memory timeline describe the graph the plan was made on (``plan.segments``
names its nodes), but a transformed module keeps only the lowered graph, where each segment is a
submodule called through the runtime. Lowering *copies* every node, annotation included, into
its segment, so inlining the segments back gives the annotated graph the planner saw, with the
same node names, without capturing the model again (which would need its inputs)::

    lowered:  x --fxckpt_checkpoint(segment_0, x)--> relu_1 --head--> out
    flat:     x --layers.0.fc--> gelu --layers.0.drop--> ... --> relu_1 --head--> out

Nothing here runs the graph; the flat GraphModule shares the lowered one's modules and tensors.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import networkx as nx
import torch
import torch.fx

from fxckpt.errors import PlanError
from fxckpt.plan import Plan
from fxckpt.runtime.selective import keep_begin, keep_end

__all__ = ["flatten", "labelled_graph", "segment_call_name"]

Env = dict[torch.fx.Node, Any]


def segment_call_name(node: torch.fx.Node, names: set[str]) -> Optional[str]:
    """The segment a lowered node calls (``fxckpt_checkpoint(segment_3, ...)``), or ``None``."""
    if node.op != "call_function" or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, torch.fx.Node) and first.op == "get_attr" and first.target in names:
        return str(first.target)
    return None


def flatten(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """A GraphModule computing what ``gm`` computes, with ``plan``'s segments inlined."""
    names = {s.name for s in plan.segments}
    flat = torch.fx.Graph()
    env: Env = {}
    for n in gm.graph.nodes:
        seg = segment_call_name(n, names)
        if seg is not None:
            env[n] = _inline(flat, gm.get_submodule(seg), [env[a] for a in n.args[1:]])
        elif n.op == "get_attr" and n.target in names:
            continue
        elif (
            n.op == "call_function"
            and n.target is operator.getitem
            and isinstance(env.get(n.args[0]), tuple)
        ):
            env[n] = env[n.args[0]][n.args[1]]
        else:
            env[n] = flat.node_copy(n, lambda a: env[a])
    try:
        flat.lint()
    except Exception as e:
        raise PlanError(f"flatten: the lowered graph does not match its plan ({e})") from e
    return torch.fx.GraphModule(gm, flat, class_name="Flat")


def _inline(flat: torch.fx.Graph, sub: torch.nn.Module, inputs: list[Any]) -> Any:
    """Copy the segment's nodes into ``flat``; its outputs (a node, or a tuple of nodes)."""
    if not isinstance(sub, torch.fx.GraphModule):
        raise PlanError(f"flatten: {type(sub).__name__} is not a lowered segment")
    env: Env = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise PlanError(
            f"flatten: segment takes {len(placeholders)} inputs but is called with {len(inputs)}"
        )
    env.update(zip(placeholders, inputs))
    for n in sub.graph.nodes:
        if n.op == "output":
            out = n.args[0]
            return tuple(env[o] for o in out) if isinstance(out, (tuple, list)) else env[out]
        if n.op == "call_function" and n.target is keep_end:  # selective recompute's brackets
            env[n] = env[n.args[1]]
        elif n.op != "placeholder" and not (n.op == "call_function" and n.target is keep_begin):
            env[n] = flat.node_copy(n, lambda a: env[a])
    raise PlanError("flatten: segment graph has no output")


def labelled_graph(gm: torch.fx.GraphModule, plan: Plan) -> nx.DiGraph:
    """The networkx view (:func:`fxckpt.cost.bridge.to_networkx`) of the flat graph, each
    node labelled with its ``segment`` (name or ``None``) and pipeline ``stage`` (index or
    ``None``)."""
    from fxckpt.cost.bridge import to_networkx

    view = to_networkx(flatten(gm, plan))
    segment = {node: seg.name for seg in plan.segments for node in seg.nodes}
    stage_of = {} if plan.pipeline is None else dict(plan.pipeline.stage_of)
    names = set(segment.values())
    seg_stage = {}
    for n in gm.graph.nodes:  # a segment's stage is the stage of the call that runs it
        seg = segment_call_name(n, names)
        if seg is not None and n.name in stage_of:
            seg_stage[seg] = stage_of[n.name]
    for node, data in view.nodes(data=True):
        seg = segment.get(node)
        data["segment"] = seg
        data["stage"] = seg_stage.get(seg) if seg is not None else stage_of.get(node)
    return view

"""Small ``torch.fx`` helpers the passes share.

* :func:`copy_graph_module`: a new GraphModule over a copy of the graph, sharing every
  submodule, parameter and buffer with the original, so one capture can be annotated and
  lowered into several plans (one per shape under a budget) without capturing again;
* :func:`outermost`: the module paths a group of nodes came from, without nested repeats.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, cast

import torch
import torch.fx

__all__ = ["copy_graph_module", "outermost"]

_CARRIED = ("_in_spec", "_out_spec", "range_constraints", "validate_inputs")
"""Plain attributes of ``ExportedProgram.module()`` its generated code and guards read."""


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule computing what ``gm`` computes, with its own graph and the same state."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out, old_output = cast(tuple[Any, torch.fx.Node], graph.graph_copy(gm.graph, env, return_output_node=True))
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = copy.copy(old_output.meta)
    graph._codegen = copy.copy(gm.graph._codegen)  # read-only (pytree specs): shared, not deep-copied
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for name in _CARRIED:
        if name in gm.__dict__:
            new.__dict__[name] = gm.__dict__[name]
    new.meta = dict(gm.meta)
    return new


def outermost(paths: Iterable[str]) -> tuple[str, ...]:
    """The outermost of these module paths (``<root>`` for ``""``), shallowest first.

    ``["layers.0.fc", "layers.0", "head"]`` -> ``("head", "layers.0")``.
    """
    unique = sorted({p or "<root>" for p in paths}, key=lambda p: (p.count("."), p))
    kept: list[str] = []
    for p in unique:
        if not any(p == k or p.startswith(k + ".") for k in kept):
            kept.append(p)
    return tuple(kept)

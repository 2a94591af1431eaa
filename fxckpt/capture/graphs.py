"""Small ``torch.fx`` helpers the passes share.

* :func:`copy_graph_module`: a new GraphModule over a copy of the graph, sharing every
  submodule, parameter and buffer with the original, so one capture can be annotated and
  lowered into several plans (one per shape under a budget) without capturing again;
* :func:`outermost`: the module paths a group of nodes came from, without nested repeats;
* :func:`compute_nodes` / :func:`planned_nodes`: the nodes that compute something (every pass
  that walks "the ops" of a graph uses these, so they agree on what an op is);
* :func:`copy_nodes`: copy some nodes into a new graph, reading parameters and buffers
  (``get_attr``) where they are used, so the new graph's module shares the original's state.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, cast

import torch
import torch.fx

__all__ = ["copy_graph_module", "outermost", "compute_nodes", "planned_nodes", "is_guard",
           "copy_nodes", "subgraph", "COMPUTE_OPS"]

COMPUTE_OPS = ("call_function", "call_method", "call_module")
"""Node kinds that compute something (not placeholders, attribute reads or the output)."""

_CARRIED = ("_in_spec", "_out_spec", "range_constraints", "validate_inputs")
"""Plain attributes of ``ExportedProgram.module()`` its generated code and guards read."""


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule computing what ``gm`` computes, with its own graph and the same state."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out, old_output = cast(
        tuple[Any, torch.fx.Node], graph.graph_copy(gm.graph, env, return_output_node=True)
    )
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = copy.copy(old_output.meta)
    graph._codegen = copy.copy(
        gm.graph._codegen
    )  # read-only (pytree specs): shared, not deep-copied
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for name in _CARRIED:
        if name in gm.__dict__:
            new.__dict__[name] = gm.__dict__[name]
    new.meta = dict(gm.meta)
    return new


def outermost(paths: Iterable[str]) -> tuple[str, ...]:
    """The outermost of these module paths (``<root>`` for ``""``), in the order they first ran.

    ``["layers.0.fc", "head", "layers.0"]`` -> ``("layers.0", "head")``: a module is listed where
    its first node (or a child's) appears, so a table reads in the order the model runs.
    """
    ordered = list(dict.fromkeys(p or "<root>" for p in paths))
    unique = sorted(ordered, key=lambda p: p.count("."))
    kept: list[str] = []
    for p in unique:
        if not any(p == k or p.startswith(k + ".") for k in kept):
            kept.append(p)
    owner = {p: next(k for k in kept if p == k or p.startswith(k + ".")) for p in ordered}
    return tuple(dict.fromkeys(owner[p] for p in ordered))


def compute_nodes(graph: torch.fx.Graph) -> Iterator[torch.fx.Node]:
    """Nodes that compute something (not placeholders, attribute reads or the output)."""
    return (n for n in graph.nodes if n.op in COMPUTE_OPS)


def is_guard(n: torch.fx.Node) -> bool:
    """torch.export's input checks (``self._guards_fn(x)``): run once, never planned."""
    return n.op == "call_module" and n.target == "_guards_fn"


def planned_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The compute nodes strategies and solvers plan over, in topological order."""
    return [n for n in compute_nodes(graph) if not is_guard(n)]


def subgraph(nodes: Iterable[torch.fx.Node], inputs: Iterable[torch.fx.Node]
             ) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
    """A new graph taking ``inputs`` as placeholders (same names and meta) and computing
    ``nodes``; the map from each node to its copy (the caller adds the output)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    copy_nodes(graph, nodes, env)
    return graph, env


def copy_nodes(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node],
               env: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Copy ``nodes`` (in order) into ``graph``, recording each copy in ``env``.

    Their inputs are looked up in ``env``, except ``get_attr`` nodes (parameters, buffers),
    which are copied into ``graph`` on first use with their meta.
    """
    def lookup(a: torch.fx.Node) -> torch.fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = graph.get_attr(str(a.target))
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)

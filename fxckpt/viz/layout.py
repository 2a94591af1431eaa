"""Where each box of the graph picture goes, and which ops share a box.

* **Plumbing.** Ops that only reshape or index (views, ``getitem``, ``size``: no bytes, no cost)
  are left out, their inputs joined to their users, unless asked for.
* **Collapse.** A picture of a thousand ops is a grey smear. Above ``max_nodes`` ops, runs of
  consecutive ops that come from the same module (at the deepest module depth that still fits),
  the same segment and the same stage become one box. Segments and stages never merge, so the
  picture keeps every segment's colour and every stage's border.
* **Layout.** Graphviz ``dot`` draws layered DAGs best; when the ``dot`` program is installed it
  is run as a subprocess (``-Tplain``, no Python binding needed). Otherwise a layered layout is
  computed here: layer = longest path from an input, spread evenly within the layer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
from typing import Optional

import networkx as nx

__all__ = ["Box", "collapse", "layout", "dot_positions", "layered_positions", "op_label",
           "hide_plumbing"]

log = logging.getLogger(__name__)

Positions = dict[str, tuple[float, float]]


@dataclasses.dataclass
class Box:
    """One drawn node: an op, a graph input, or a run of ops collapsed together."""

    name: str
    label: str
    ops: list[str]
    segment: Optional[str]
    stage: Optional[int]
    kind: str
    """``op``, ``input`` or ``group``."""


def _prefix(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def collapse(view: nx.DiGraph, ops: list[str], max_nodes: int) -> tuple[list[Box], nx.DiGraph]:
    """The boxes to draw and the graph between them (ops themselves when there are few)."""
    depth: Optional[int] = None
    if len(ops) > max_nodes:
        deepest = max(
            (len(view.nodes[n].get("module_path", "").split(".")) for n in ops), default=1
        )
        depth = next(
            (d for d in range(deepest, -1, -1) if len(_runs(view, ops, d)) <= max_nodes), 0
        )
    boxes = [
        Box(n, n, [n], None, None, "input")
        for n, d in view.nodes(data=True)
        if d.get("kind") == "input"
    ]
    if depth is None:
        boxes += [
            Box(n, op_label(n, view.nodes[n].get("module_path", "")), [n],
                view.nodes[n].get("segment"), view.nodes[n].get("stage"), "op")
            for n in ops
        ]
    else:
        boxes += _runs(view, ops, depth)
    owner = {op: b.name for b in boxes for op in b.ops}
    graph = nx.DiGraph()
    graph.add_nodes_from(b.name for b in boxes)
    graph.add_edges_from((owner[u], owner[v]) for u, v in view.edges()
                         if u in owner and v in owner and owner[u] != owner[v])
    return boxes, graph


def op_label(name: str, module_path: str) -> str:
    """How a node is labelled: by its module path (``layers.0.fc``, as the plan tables name it),
    an op inside a module as ``layers.0: gelu``, an op of the model's own forward by its name.

    fx names a module call after its path (``layers_0_fc``) and an op after its function, with a
    counter when it repeats (``gelu_3``), so the counter is dropped where the path says where.
    """
    if not module_path:
        return name
    flat = module_path.replace(".", "_")
    if name == flat or re.fullmatch(re.escape(flat) + r"_\d+", name):
        return module_path
    base = re.sub(r"_\d+$", "", name)
    return f"{module_path}: {base}"


def hide_plumbing(view: nx.DiGraph, ops: list[str]) -> tuple[nx.DiGraph, list[str]]:
    """The view without ops that only reshape or index (views, ``getitem``, ``size``: no bytes,
    no cost), each replaced by edges from its inputs to its users."""
    plumbing = [n for n in ops if _is_plumbing(view.nodes[n])]
    if not plumbing:
        return view, ops
    view = view.copy()
    for n in plumbing:
        view.add_edges_from((p, u) for p in view.predecessors(n) for u in view.successors(n))
        view.remove_node(n)
    hidden = set(plumbing)
    return view, [n for n in ops if n not in hidden]


def _is_plumbing(data: dict) -> bool:
    return not (data.get("out_bytes") or data.get("cost") or data.get("internal"))


def _runs(view: nx.DiGraph, ops: list[str], depth: int) -> list[Box]:
    boxes: list[Box] = []
    last = None
    for n in ops:
        d = view.nodes[n]
        key = (d.get("segment"), d.get("stage"), _prefix(d.get("module_path", ""), depth))
        if key != last:
            label = key[2] or "<root>"
            boxes.append(Box(f"{label}#{len(boxes)}", label, [], key[0], key[1], "group"))
            last = key
        boxes[-1].ops.append(n)
    return boxes


def layout(graph: nx.DiGraph, engine: str = "auto") -> tuple[Positions, str]:
    """Positions (x right, y up; inputs on top) and the engine used: ``dot`` or ``layered``."""
    if engine not in ("auto", "dot", "layered"):
        raise ValueError(f"layout must be 'auto', 'dot' or 'layered' (got {engine!r})")
    if engine in ("auto", "dot"):
        positions = dot_positions(graph)
        if positions is not None:
            return positions, "dot"
        if engine == "dot":
            raise RuntimeError(
                "layout='dot' needs Graphviz's dot program on PATH (apt install graphviz)"
            )
    return layered_positions(graph), "layered"


def dot_positions(graph: nx.DiGraph, timeout: float = 60.0) -> Optional[Positions]:
    """Positions from Graphviz ``dot -Tplain``, or ``None`` when ``dot`` is missing or fails."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    ids = {n: f"n{i}" for i, n in enumerate(graph.nodes)}
    text = "digraph G {\n" + "".join(f"{i};\n" for i in ids.values())
    text += "".join(f"{ids[u]} -> {ids[v]};\n" for u, v in graph.edges()) + "}\n"
    try:
        out = subprocess.run(
            [exe, "-Tplain"],
            input=text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("graphviz dot failed (%s); using the layered layout", e)
        return None
    back = {v: k for k, v in ids.items()}
    positions = parse_plain(out.stdout, back)
    return positions if len(positions) == len(ids) else None


def parse_plain(text: str, names: dict[str, str]) -> Positions:
    """``node ID X Y ...`` lines of Graphviz's plain format, by original node name."""
    positions = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "node" and parts[1] in names:
            positions[names[parts[1]]] = (float(parts[2]), float(parts[3]))
    return positions


def layered_positions(graph: nx.DiGraph) -> Positions:
    """Layer = longest path from a source; nodes of a layer spread evenly around x = 0."""
    layer: dict[str, int] = {}
    for n in nx.topological_sort(graph):
        layer[n] = max((layer[p] + 1 for p in graph.predecessors(n)), default=0)
    by_layer: dict[int, list[str]] = {}
    for n, k in layer.items():
        by_layer.setdefault(k, []).append(n)
    positions = {}
    for k, nodes in by_layer.items():
        for i, n in enumerate(nodes):
            positions[n] = (i - (len(nodes) - 1) / 2, -float(k))
    return positions

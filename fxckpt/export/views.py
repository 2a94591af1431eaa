"""Graph views as JSON, so a loaded module can still be drawn and its memory predicted.

The networkx view (:func:`fxckpt.cost.bridge.to_networkx`) is plain data: node names,
kinds, bytes, costs, module paths and data-flow edges. It is written with a small fixed layout
(not networkx's node-link format, whose arguments change between versions).
"""

from __future__ import annotations

import json
from typing import Any

import networkx as nx

__all__ = ["view_to_json", "view_from_json"]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def view_to_json(view: nx.DiGraph) -> str:
    data = {
        "graph": {k: _plain(v) for k, v in view.graph.items()},
        "nodes": [[n, {k: _plain(v) for k, v in d.items()}] for n, d in view.nodes(data=True)],
        "edges": [[u, v] for u, v in view.edges()],
    }
    return json.dumps(data, separators=(",", ":"))


def view_from_json(text: str) -> nx.DiGraph:
    data = json.loads(text)
    view = nx.DiGraph()
    view.graph.update(
        {k: tuple(v) if isinstance(v, list) else v for k, v in data["graph"].items()}
    )
    for name, attrs in data["nodes"]:
        view.add_node(
            name, **{k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
        )
    view.add_edges_from((u, v) for u, v in data["edges"])
    return view

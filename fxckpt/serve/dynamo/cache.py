"""What Dynamo caches for fxckpt: one backend for every transformed module, and graphs that
run the plan of the module whose call is running.

Dynamo keeps compiled graphs per code object and counts them against its recompile limit. The
model's own ``forward`` is compiled from a copy per transformed module, but a frame Dynamo
compiles on its own (a block's ``forward`` after a graph break in a loop, a function a break
left) is the class's code, shared by every module that runs it. With a backend per module each
module added graphs there, and from about the fifth transform of such a model in one process (a
notebook comparing strategies) training calls ran with no graph at all. With one backend, a
frame keeps one graph per guard set; the graph (:class:`SharedGraph`) asks the module whose call
runs (:func:`running`) for its own plan of it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional, Protocol

import torch
import torch.fx

from fxckpt.serve.dynamo.backend import GraphRunner
from fxckpt.serve.sizes import is_dynamic
from fxckpt.capture.eager_attention import eager_attention
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.runtime.attention import planning

__all__ = ["Planner", "SharedGraph", "backend", "running", "running_planner"]


class Planner(Protocol):
    """What a :class:`SharedGraph` asks for the plan of the transformed module whose call runs
    (:class:`~fxckpt.serve.dynamo.driver.DynamoDriver`)."""

    def graph_compiled(self, graph: "SharedGraph", gm: torch.fx.GraphModule,
                       inputs: list[Any]) -> None:
        """Dynamo compiled ``graph`` during this module's call (``gm``: a copy to plan, with the
        call's ``inputs``)."""

    def runner_for(self, graph: "SharedGraph", args: tuple) -> GraphRunner:
        """What runs ``graph`` for this module (planned now if it has no plan for it)."""


_running = threading.local()


@contextlib.contextmanager
def running(planner: Planner) -> Iterator[None]:
    """The transformed module whose training call runs on this thread, while it runs."""
    outer = getattr(_running, "planner", None)
    _running.planner = planner
    try:
        yield
    finally:
        _running.planner = outer


def running_planner() -> Optional[Planner]:
    """The module whose training call runs on this thread (``None`` outside any)."""
    return getattr(_running, "planner", None)


class SharedGraph:
    """What Dynamo caches and calls for one graph it captured: the graph as captured, run with
    the plan of the transformed module whose call is running. A graph one module's call
    compiled serves another's, which plans it (from :attr:`base`) at its first call that
    reaches it: a graph never runs another module's plan."""

    def __init__(self, base: torch.fx.GraphModule, dynamic: bool,
                 ended_by: tuple[str, ...]) -> None:
        self.base = base
        """The graph as Dynamo captured it (never planned or lowered: each module copies it)."""
        self.dynamic = dynamic
        """Whether its sizes are symbolic (it serves calls of several sizes)."""
        self.ended_by = ended_by

    def __call__(self, *args: Any) -> Any:
        planner = running_planner()
        if planner is None:  # reached outside any training call of a transformed module
            return self.base(*args)
        return planner.runner_for(self, args)(*args)


def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> SharedGraph:
    """fxckpt's Dynamo backend: one function for every transformed module, so that a frame
    they share keeps one graph per guard set instead of one per module (Dynamo's recompile
    limit counts them), each module planning it for itself (:class:`SharedGraph`). Its masked
    attention calls go through :mod:`fxckpt.capture.eager_attention` first."""
    now = _breaks()  # counted before Dynamo compiles the graph a break ends
    reasons = tuple(r.strip().splitlines()[0] for r in now if now[r] > _BREAKS_SEEN.get(r, 0))
    _BREAKS_SEEN.clear()
    _BREAKS_SEEN.update(now)
    eager_attention(gm)  # the kernels eager code calls, where tracing built a mask it skips
    graph = SharedGraph(copy_graph_module(gm), is_dynamic(inputs), reasons)
    planner = running_planner()
    if planner is not None:
        with planning():  # its fake runs model the kernels a real step runs
            planner.graph_compiled(graph, gm, inputs)
    return graph


_BREAKS_SEEN: dict[str, int] = {}
"""Dynamo's graph-break counts when the latest graph was compiled: the breaks counted since
are what ended the next one."""


def _breaks() -> dict[str, int]:
    """Dynamo's count of graph breaks, by reason (its own words)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])

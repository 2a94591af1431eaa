"""serve/dynamo/cache.py: one backend for every transformed module; each graph it returns runs
the plan of the module whose call is running on this thread, or the graph as captured outside
any."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.fx
from torch._dynamo.utils import counters

from fxckpt.serve.dynamo.cache import SharedGraph, backend, running, running_planner


class Recorder:
    """A planner that notes what it is asked and runs graphs doubled."""

    def __init__(self) -> None:
        self.compiled: list[tuple[SharedGraph, list[Any]]] = []
        self.asked: list[tuple] = []

    def graph_compiled(self, graph: SharedGraph, gm: torch.fx.GraphModule,
                       inputs: list[Any]) -> None:
        self.compiled.append((graph, inputs))

    def runner_for(self, graph: SharedGraph, args: tuple) -> Any:
        self.asked.append(args)
        return lambda *a: 2 * graph.base(*a)


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.ReLU())


def test_the_running_planner_is_per_thread_and_nests() -> None:
    outer, inner = Recorder(), Recorder()
    assert running_planner() is None
    with running(outer):
        with running(inner):
            assert running_planner() is inner
            seen = []
            thread = threading.Thread(target=lambda: seen.append(running_planner()))
            thread.start()
            thread.join()
            assert seen == [None]
        assert running_planner() is outer
    assert running_planner() is None


def test_a_shared_graph_runs_the_running_modules_plan_or_the_graph_as_captured() -> None:
    graph = SharedGraph(_gm(), dynamic=False, ended_by=())
    x = torch.tensor([-1.0, 2.0])
    assert torch.equal(graph(x), torch.tensor([0.0, 2.0]))
    planner = Recorder()
    with running(planner):
        assert torch.equal(graph(x), torch.tensor([0.0, 4.0]))
    assert len(planner.asked) == 1 and planner.asked[0][0] is x


def test_the_backend_hands_the_graph_to_the_running_module_with_the_breaks_since() -> None:
    planner = Recorder()
    gm, x = _gm(), torch.ones(2)
    saved = dict(counters["graph_break"])
    try:
        backend(gm, [x])  # the counts so far are seen
        counters["graph_break"]["Unsupported: print()\nmore words"] += 1
        with running(planner):
            graph = backend(gm, [x])
    finally:
        counters["graph_break"].clear()
        counters["graph_break"].update(saved)
    assert planner.compiled == [(graph, [x])]
    assert graph.ended_by == ("Unsupported: print()",) and not graph.dynamic
    assert graph.base is not gm  # a copy each module plans from
    assert backend(gm, [x]).ended_by == ()

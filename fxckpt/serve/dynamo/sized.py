"""Plans by size for a graph Dynamo made dynamic, under a budget: the plan cache's rules.

After a call with new sizes Dynamo compiles a graph whose sizes are symbolic (automatic dynamic
shapes), once, and serves every later size with it. A plan under a budget depends on sizes: one
made at 256 rows holds its budget at 256 rows, not at 2,048. :class:`SizedRunner` is what Dynamo
calls for such a graph; it serves each call by the size policy a whole graph's calls follow
(:class:`~fxckpt.serve.plan_cache.PlanCache`): a smaller call reuses a larger call's plan, a
call larger than every plan so far is checked (or planned) at its grown sizes rounded up to the
next power of two, the unmodified step first, and at most
:data:`~fxckpt.serve.plan_cache.MAX_PLANS` plans are kept. A batch that grows by one each step
is planned a few times, not at every step.

Bucketed sizes are planned on placeholder inputs (:meth:`GraphPlanner.padded`): the tensors
padded as fake tensors (planning happens during the step: a placeholder of real memory would add
to its peak), and each size Dynamo passes as an integer input (``s0``) set to the padded tensor's
dimension that is that symbol, read from the graph's own placeholders. An integer input that is
no tensor's dimension (a counter on the module) keeps the call's value.

With a graph break, a graph's budget is what the earlier graphs of the step keep: each graph
served at sizes its plan was checked or made at (a bucket, larger than the call) counts what it
keeps at those sizes, which holds for every call it serves, and a later graph's plan must hold
the budget less that (:meth:`GraphPlanner.limit`). Where a graph after a break cannot fit beside
what earlier graphs keep at their buckets, the module plans every size as it comes from then on.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from fxckpt.budget import Budget
from fxckpt.plan import Plan
from fxckpt.serve.dynamo.backend import (
    GraphRecord, GraphRunner, concrete, graph_peak, held_at_end,
)
from fxckpt.serve.plan_cache import PlanCache
from fxckpt.serve.sizes import padded_args, sizes_of
from fxckpt.signature import Shapes

__all__ = ["GraphPlanner", "GraphPlans", "SizedRunner", "size_inputs"]


class GraphPlans(Protocol):
    """What plans a Dynamo graph for the module whose call runs
    (:class:`~fxckpt.serve.dynamo.driver.DynamoDriver`)."""

    device: str
    counts: Optional[Any]
    """The transformed module's counts (its ``plan_seconds`` include the checks)."""

    def plan(self, gm: torch.fx.GraphModule, inputs: list[Any], reasons: tuple[str, ...],
             budget: Optional[Budget] = None, eager: Optional[int] = None,
             placeholder: bool = False) -> GraphRecord:
        """Plan ``gm`` (a copy to lower) for the call running now, at these inputs."""

    def leftover(self, plan: Plan) -> Optional[int]:
        """The bytes ``plan`` must hold at larger sizes, beside the step's other graphs."""


def size_inputs(gm: torch.fx.GraphModule) -> dict[int, tuple[int, int]]:
    """Position of each integer input that is a tensor input's dimension -> ``(tensor, dim)``:
    the tensor's index among the graph's tensor inputs and the dimension that is that symbol."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[str, tuple[int, int]] = {}
    tensors = 0
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(str(size.node.expr), (tensors, d))
            tensors += 1
    found = {}
    for position, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and str(value.node.expr) in dims:
            found[position] = dims[str(value.node.expr)]
    return found


class GraphPlanner:
    """How one module's plans of one dynamic Dynamo graph are made and checked
    (:class:`~fxckpt.serve.plan_cache.Planner`): built by the driver from the graph as Dynamo
    captured it, checked by running the lowered graph on fake tensors."""

    def __init__(self, driver: GraphPlans, base: torch.fx.GraphModule,
                 ended_by: tuple[str, ...]) -> None:
        self.driver = driver
        self.base = base
        self.ended_by = ended_by
        self.sizes = size_inputs(base)
        self.held: dict[tuple[int, Shapes], int] = {}
        """Bytes a plan keeps for backward at the sizes it was checked at (by plan index)."""

    def shapes(self, args: tuple, kwargs: dict) -> Shapes:
        return sizes_of(args)

    def accepts(self, shapes: Shapes) -> bool:
        return True  # a static dimension never differs (Dynamo compiles again), the rest vary

    def build(self, args: tuple, kwargs: dict, budget: Optional[Budget] = None,
              eager: Optional[int] = None) -> GraphRecord:
        from fxckpt.capture.graphs import copy_graph_module

        placeholder = any(isinstance(a, FakeTensor) for a in args)
        with _disable_current_modes():  # planning runs no user mode, as at compile time
            return self.driver.plan(copy_graph_module(self.base), list(args), self.ended_by,
                                    budget=budget, eager=eager, placeholder=placeholder)

    def peak_at(self, planned: GraphRecord, args: tuple, kwargs: dict) -> Optional[int]:
        from fxckpt.errors import VerifyError

        start = time.perf_counter()
        try:
            with _disable_current_modes():
                inputs = concrete(list(args))
                peak = graph_peak(planned.gm, inputs, self.driver.device)
                self.held[planned.index, sizes_of(args)] = held_at_end(planned.gm, inputs)
            return peak
        except VerifyError:
            return None
        finally:
            if self.driver.counts is not None:
                self.driver.counts.plan_seconds += time.perf_counter() - start

    def limit(self, planned: GraphRecord) -> Optional[int]:
        return self.driver.leftover(planned.plan)

    def held_for(self, record: GraphRecord, sizes: Optional[Shapes]) -> int:
        """What ``record`` keeps for backward at most, serving calls up to ``sizes`` (the sizes
        it was made or checked at)."""
        if sizes is None:
            return record.held_bytes
        return self.held.get((record.index, sizes), record.held_bytes)

    def padded(self, args: tuple, kwargs: dict, key: Shapes, grown: set[tuple[int, int]],
               scale: int = 1) -> Optional[tuple[tuple, dict]]:
        padded = padded_args(args, {}, key, grown, scale, fake=True)
        if padded is None:
            return None
        inputs = list(padded[0])
        tensors = [i for i in inputs if isinstance(i, torch.Tensor)]
        for position, (tensor, dim) in self.sizes.items():
            inputs[position] = tensors[tensor].shape[dim]
        return tuple(inputs), {}


class SizedRunner(GraphRunner):
    """What Dynamo calls for a dynamic graph under a budget (see the module docstring)."""

    def __init__(self, planner: GraphPlanner, inputs: list[Any],
                 ran: Callable[[GraphRecord], None],
                 around: Callable[[], ContextManager[None]],
                 bucketed: Callable[[], bool]) -> None:
        self.planner = planner
        self.cache: PlanCache[GraphRecord] = PlanCache()
        self.bucketed = bucketed
        self.promised: dict[tuple[int, int], GraphRecord] = {}
        args = tuple(concrete(list(inputs)))
        super().__init__(self._serve(args), ran, around)

    def record_for(self, args: tuple) -> GraphRecord:
        """The plan for a call of these inputs, made now when none serves its sizes."""
        return self._serve(args)

    def _serve(self, args: tuple) -> GraphRecord:
        if not self.bucketed():  # a graph after a break did not fit beside buckets' promises
            self.cache.buckets = False
        record, _ = self.cache.serve(sizes_of(args), args, {}, self.planner)
        held = self.planner.held_for(record, self.cache.served)
        if held == record.held_bytes:
            return record
        # served at sizes it was checked at, not made at: later graphs of the step are planned
        # beside what it keeps there
        promised = self.promised.get((record.index, held))
        if promised is None:
            promised = dataclasses.replace(record, held_bytes=held)
            self.promised[record.index, held] = promised
        return promised

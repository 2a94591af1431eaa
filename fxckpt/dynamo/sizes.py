"""Plans by size for a graph Dynamo made dynamic, under a budget.

After a call with new sizes Dynamo compiles a graph whose sizes are symbolic (automatic dynamic
shapes), once, and serves every later size with it. A plan under a budget depends on sizes: one
made at 256 rows holds its budget at 256 rows, not at 2,048. :class:`SizedRunner` is what Dynamo
calls for such a graph: each call runs the plan made for the smallest sizes that cover its own
(a smaller call holds less under the same plan), and a call larger than every plan so far is
planned at its own sizes first, on the graph as Dynamo captured it, with the call's tensors as
examples. A batch that grows step by step is planned at each new largest size; one that varies
below its largest (dynamic padding) is planned once per new largest.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxckpt.dynamo.backend import GraphRecord, GraphRunner
from fxckpt.planning.sizes import volume
from fxckpt.signature import Shapes, dominates

__all__ = ["SizedRunner", "is_dynamic", "sizes_of"]

def is_dynamic(inputs: list[Any]) -> bool:
    """Whether Dynamo handed over a graph with symbolic sizes (they arrive as SymInt inputs)."""
    return any(isinstance(i, torch.SymInt) for i in inputs)


def sizes_of(args: tuple) -> Shapes:
    """The shapes of a call's tensor inputs (its integer inputs are not sizes: a counter the
    module keeps is one)."""
    return tuple(tuple(int(d) for d in a.shape) for a in args if isinstance(a, torch.Tensor))


class SizedRunner(GraphRunner):
    """What Dynamo calls for a dynamic graph under a budget (see the module docstring)."""

    def __init__(self, first: GraphRecord, sizes: Shapes,
                 plan_at: Callable[[list[Any]], GraphRecord],
                 ran: Callable[[GraphRecord], None],
                 around: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        super().__init__(first, ran, around)
        self.plans: list[tuple[Shapes, GraphRecord]] = [(sizes, first)]
        self.plan_at = plan_at

    def record_for(self, args: tuple) -> GraphRecord:
        """The plan for a call of these inputs, made now when none covers its sizes."""
        call = sizes_of(args)
        covering = [(s, r) for s, r in self.plans if dominates(s, call)]
        if covering:
            return min(covering, key=lambda sr: volume(sr[0]))[1]
        with _disable_current_modes():  # planning runs no user mode, as at compile time
            record = self.plan_at(list(args))
        self.plans.append((call, record))
        return record

"""The training forward of one transformed module, compiled by Dynamo with fxckpt as backend.

The model's own ``forward`` is compiled (``torch.compile(type(model).forward,
backend=...)``), and a training call runs it with the transformed module as ``self``. Around
each call the driver turns on the Dynamo guard that is off by default and that training needs:
hooks added or removed after the first call (``skip_nnmodule_hook_guards``). Everything else a
step depends on is Dynamo's to guard: attribute values however deep, globals, closures, class
attributes, training flags, ``requires_grad``.

Dynamo compiles with :func:`fxckpt.serve.dynamo.cache.backend`, one function for every transformed
module; each module plans each graph its calls run for itself (:mod:`fxckpt.serve.dynamo.cache`).

The driver keeps every graph it planned (:class:`~fxckpt.serve.dynamo.backend.GraphRecord`) and the
graphs the current call ran, in order: a graph planned during a call is given the budget the
earlier graphs of the step leave (their saved tensors stay alive until backward), so a budget in
bytes holds for the whole step across graph breaks. A fraction is of each graph's own step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import random
import time
import types
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxckpt.budget import Budget
from fxckpt.config import TransformConfig
from fxckpt.capture import generators
from fxckpt.errors import AfterBreakInfeasible, FxckptError
from fxckpt.serve.dynamo.backend import (
    GraphRecord, GraphRunner, at_smallest, concrete, held_at_end,
    plan_graph,
)
from fxckpt.serve.dynamo.cache import SharedGraph, backend, running
from fxckpt.plan import Plan
from fxckpt.strategy import Budgeted
from fxckpt.serve.dynamo.share import Outside, graph_runs
from fxckpt.serve.dynamo.refusals import refuse_python_draws, uncompiled_here
from fxckpt.serve.dynamo.sized import GraphPlanner, SizedRunner
from fxckpt.capture.graphs import copy_graph_module

__all__ = ["DynamoDriver"]

log = logging.getLogger(__name__)


class DynamoDriver:
    """Compiles the model's forward once, and plans each graph Dynamo captures of it."""

    def __init__(self, model: torch.nn.Module, config: TransformConfig,
                 offloader: Optional[Any] = None, counts: Optional[Any] = None) -> None:
        self.config = config
        self.offloader = offloader
        self.offloads_all = offloader if config.offload is True else None
        """The offloader whose hooks each graph runs under (``offload=True``; with ``"auto"``
        the plan's segments offload on their own)."""
        self.counts = counts
        """The transformed module's counts (``inspect(tm).captures``, ``plans_made``): one
        capture and one plan per graph Dynamo hands over."""
        self.records: list[GraphRecord] = []
        """Every graph planned so far, in the order Dynamo compiled them."""
        self.step: list[GraphRecord] = []
        """The graphs the current (or latest) call ran, in order."""
        self.device = _device_of(model)
        self.compiles = 0
        """Graphs Dynamo compiled (a graph planned again for larger sizes is not one)."""
        self.said: set[str] = set()
        """Why calls ran without any graph, each said once ("" for Dynamo's own reasons)."""
        self.compiling_calls = 0
        """Calls in a row that compiled a graph (a fact the forward reads changes each call)."""
        self.warned = False
        self.guards = GUARDS
        self._python_generators: list[tuple[str, random.Random]] = []
        self._scanned = -1
        """How many graphs there were when the module was last searched for generators."""
        self.meter: Optional[Outside] = None
        """The measure of what runs unplanned, while a call is measured."""
        self.measure_next = True
        """Whether the next call is measured (the first, and the one after a compile)."""
        self.unplanned_share: Optional[float] = None
        """The share of the forward's FLOPs that ran outside planned graphs at the latest
        measured call (``inspect(tm).unplanned_share``)."""
        self.share_warned = False
        self.reserves: dict[int, int] = {}
        """Bytes the graph at each position of the step keeps free for the graphs after it
        (their smallest peaks, learnt when one could not fit: :meth:`_at_smallest`)."""
        self.smallest: dict[int, int] = {}
        self.replan_due = False
        self.replans = 0
        self.unbucketed = False
        """Whether dynamic graphs are planned at each call's own sizes only: set when a graph
        after a break could not fit beside what earlier graphs promised at their buckets."""
        self.runners: weakref.WeakKeyDictionary[SharedGraph, GraphRunner] = (
            weakref.WeakKeyDictionary())
        """This module's plan of each graph Dynamo compiled that its calls ran (some compiled by
        other modules' calls: :class:`~fxckpt.serve.dynamo.cache.SharedGraph`)."""
        self.model_forward = type(model).forward
        self.compiled = self._compile()

    def __call__(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        from torch._dynamo.utils import guard_failures

        self.step = []
        compiled_before = self.compiles
        failures = {code: len(seen) for code, seen in guard_failures.items()}
        if self._scanned != self.compiles:  # a compile may have met a new generator
            self._python_generators = [(path, g) for path, g in generators.held_generators(tm)
                                       if isinstance(g, random.Random)]
            self._scanned = self.compiles
        held = [(path, g, generators.state_of(g)) for path, g in self._python_generators]
        uncompiled = uncompiled_here()
        self.meter = Outside() if self.measure_next and not uncompiled else None
        if self.offloads_all is not None:
            self.offloads_all.begin(tm)  # each graph's saved tensors offloaded as it runs
        try:
            with self._patch, self.meter or contextlib.nullcontext(), running(self):
                out = self.compiled(tm, *args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, FxckptError):  # fxckpt's own refusal, as it raised it
                raise inner.with_traceback(None) from None
            raise
        finally:
            meter, self.meter = self.meter, None
        refuse_python_draws(held)
        if self.replan_due:
            self._replan()
        self._storms(compiled_before, failures)
        self.measure_next = self.compiles > compiled_before
        if meter is not None and self.step:
            self._unplanned(tm, meter)
        if not self.step:
            self._no_graph(tm, uncompiled)
        return out

    def inside_outer_compile(self, tm: torch.nn.Module) -> None:
        """Say once that a ``torch.compile(tm)`` around this module compiles nothing more."""
        if "outer" in self.said:
            return
        self.said.add("outer")
        log.warning(
            "fxckpt: torch.compile around %s, transformed with capture='dynamo', compiles "
            "nothing more: fxckpt already compiles its training forward with Dynamo (each graph "
            "planned and run eagerly), so the outer compile breaks its graph at the call and "
            "the step runs as planned, exact, without inductor. For the plan inside an inductor "
            "graph, transform with capture='graph' and compile that (docs/compile.md)",
            type(tm).__name__)

    def _no_graph(self, tm: torch.nn.Module, uncompiled: str) -> None:
        """Say once per reason that a call ran no graph: nothing planned, nothing saved."""
        if uncompiled in self.said:
            return
        self.said.add(uncompiled)
        if uncompiled:
            log.warning(
                "fxckpt: a training call of %s ran under %s: Dynamo does not compile there, so "
                "the model's own forward ran, unplanned, saving no memory (exact all the "
                "same). Count FLOPs around backward only, measure memory without a dispatch "
                "mode (fxckpt.measure, torch.cuda.max_memory_allocated)", type(tm).__name__,
                uncompiled)
        else:
            log.warning(
                "fxckpt: Dynamo ran this training call of %s without a graph (it skipped the "
                "forward's frame, or its recompile limit was reached): nothing was planned, and "
                "the step saves no memory. TORCH_LOGS=recompiles,graph_breaks says why",
                type(tm).__name__)

    @property
    def guards(self) -> dict[str, Any]:
        """The Dynamo settings this module's calls compile under (the bench times defaults)."""
        return self._guards

    @guards.setter
    def guards(self, settings: dict[str, Any]) -> None:
        self._guards = dict(settings)
        self._patch = torch._dynamo.config.patch(**self._guards)  # built once, entered per call

    def _unplanned(self, tm: torch.nn.Module, meter: Outside) -> None:
        """Keep the measured share, and say once when much of the forward runs unplanned."""
        self.unplanned_share = meter.share
        if self.share_warned or meter.share is None or meter.share < UNPLANNED_WARNING:
            return
        self.share_warned = True
        reasons = sorted({r for record in self.step for r in record.ended_by})
        log.warning(
            "fxckpt: %.0f%% of the training forward of %s (by FLOPs) ran outside the graphs "
            "Dynamo captured, unplanned: its activations are kept whatever the plan. Dynamo's "
            "reasons: %s. inspect(tm).graphs lists the graphs; TORCH_LOGS=graph_breaks shows "
            "each break", 100 * meter.share, type(tm).__name__,
            "; ".join(reasons) or "a frame or function it does not compile")

    def _storms(self, before: int, failures: dict[Any, int]) -> None:
        """Say once, naming Dynamo's reason, when every call compiles again."""
        self.compiling_calls = self.compiling_calls + 1 if self.compiles > before else 0
        if self.compiling_calls < RECOMPILE_WARNING or self.warned or self.compiles < 2:
            return
        from torch._dynamo.utils import guard_failures

        reasons = [
            r for code, seen in guard_failures.items() for r in seen[failures.get(code, 0):]
        ]
        reasons = reasons or ["a guard failed"]
        limit = torch._dynamo.config.recompile_limit
        log.warning(
            "fxckpt: Dynamo compiled the forward again at each of the last %d calls (its reason: "
            "%s): a Python value the forward reads changes every call (a list it appends to, an "
            "attribute it sets). Each compile plans again, and after %d "
            "(torch._dynamo.config.recompile_limit) Dynamo runs the forward unplanned, exact but "
            "without saving memory. Keep such a value out of the forward, or in a buffer",
            self.compiling_calls, str(reasons[-1]).strip().splitlines()[0], limit)
        self.warned = True

    def graph_compiled(self, graph: SharedGraph, gm: torch.fx.GraphModule,
                       inputs: list[Any]) -> None:
        """Dynamo compiled ``graph`` during this module's call: planned now, with the call's
        inputs."""
        self.compiles += 1
        self.runners[graph] = self._runner(graph, list(inputs), gm)

    def runner_for(self, graph: SharedGraph, args: tuple) -> GraphRunner:
        """This module's runner of ``graph``; a graph another module's call compiled (a frame
        both run) is planned at the first call of this module that reaches it."""
        runner = self.runners.get(graph)
        if runner is None:
            with _disable_current_modes():  # planning runs no user mode, as at compile time
                runner = self._runner(graph, list(args))
            self.runners[graph] = runner
        return runner

    def _runner(self, graph: SharedGraph, inputs: list[Any],
                gm: Optional[torch.fx.GraphModule] = None) -> GraphRunner:
        """This module's runner of ``graph`` (``gm``: a copy to plan, else made from its base
        when one plan serves every call)."""
        ended_by = graph.ended_by
        if self.config.budget is None or not graph.dynamic:
            gm = copy_graph_module(graph.base) if gm is None else gm
            return GraphRunner(self.plan(gm, inputs, ended_by), self._ran, self._around)
        # planned by size, as captured: from ``graph.base``, not ``graph`` (which holds this
        # module's runners only weakly, as keys)
        return SizedRunner(GraphPlanner(self, graph.base, ended_by), inputs, self._ran,
                           self._around, bucketed=lambda: not self.unbucketed)

    @contextlib.contextmanager
    def _around(self) -> Iterator[None]:
        """Around each graph's run: the measure of what runs unplanned, and with
        ``offload=True`` the hooks that move what the graph saves for backward."""
        offloader = self.offloads_all
        with graph_runs(self.meter), (
                offloader.saving() if offloader is not None else contextlib.nullcontext()):
            yield

    def plan(self, gm: torch.fx.GraphModule, inputs: list[Any], reasons: tuple[str, ...],
             budget: Optional[Budget] = None, eager: Optional[int] = None,
             placeholder: bool = False) -> GraphRecord:
        """Plan one graph for the call running now (after the graphs of ``self.step``;
        ``reasons``: why Dynamo ended it; ``budget``: instead of the configured one; ``eager``:
        the unmodified graph's verified peak at these inputs, when known; ``placeholder``: the
        inputs are bucketed placeholders, and a graph that cannot fit there is refused, to be
        planned at the call's own sizes)."""
        config = self.config if budget is None else dataclasses.replace(
            self.config, strategy=Budgeted(budget))
        start = time.perf_counter()
        held = sum(r.held_bytes for r in self.step)
        position = len(self.step)
        try:
            plan, lowered = plan_graph(gm, list(inputs), config, device=self.device,
                                       held_before=held, offloader=self.offloader,
                                       reserve=self.reserves.get(position, 0), eager=eager)
        except AfterBreakInfeasible as e:
            if placeholder or self.replans >= MAX_REPLANS:
                raise
            self.unbucketed = True  # what earlier graphs promised at their buckets left no room
            plan, lowered = self._at_smallest(gm, inputs, position, e)
        held_end = held_at_end(lowered, concrete(list(inputs)))
        record = GraphRecord(len(self.records), lowered, plan, held_end,
                             held_before=held, ended_by=reasons)
        self.records.append(record)
        if self.counts is not None:
            self.counts.captures += 1
            self.counts.plans += 1
            self.counts.plan_seconds += time.perf_counter() - start
        log.info("planned Dynamo graph %d: %s%s", record.index, plan.summary(),
                 f" (Dynamo ended it: {'; '.join(reasons)})" if reasons else "")
        return record

    def leftover(self, plan: Plan) -> Optional[int]:
        """The bytes a verified budget plan of the graph about to run must hold to serve larger
        sizes: a budget in bytes less what the earlier graphs of this step keep (at most, for
        the sizes they serve) and the room kept for later graphs; a fraction's own bytes."""
        budget = self.config.budget
        if plan.verified_peak is None or budget is None:
            return None
        if budget.bytes is None:
            return plan.budget_bytes
        held = sum(r.held_bytes for r in self.step)
        return max(1, budget.bytes - held - self.reserves.get(len(self.step), 0))

    def _at_smallest(self, gm: torch.fx.GraphModule, inputs: list[Any], position: int,
                     e: AfterBreakInfeasible) -> tuple[Plan, torch.fx.GraphModule]:
        """A graph after a break that cannot fit beside what the earlier graphs keep: planned at
        its smallest peak for this call, and the step's graphs planned again at the next call
        with that peak kept for it (:meth:`_replan`)."""
        self.smallest[position] = max(self.smallest.get(position, 0), e.graph_peak)
        self.replan_due = True
        plan, lowered = plan_graph(gm, list(inputs), at_smallest(self.config, e.graph_peak),
                                   device=self.device, offloader=self.offloader)
        note = (f"over the budget at this call: the earlier graphs of the step keep "
                f"{e.min_budget - e.graph_peak} bytes and this graph's smallest peak is "
                f"{e.graph_peak}; the next call plans the earlier graphs again with "
                f"{e.graph_peak} bytes kept for it")
        log.warning("fxckpt: Dynamo graph %d of the step is %s", position, note)
        return dataclasses.replace(plan, notes=plan.notes + (note,)), lowered

    def _replan(self) -> None:
        """Compile the forward afresh, each graph of the step keeping room for the smallest
        peaks of the graphs after it (its budget is what earlier graphs leave, less that)."""
        self.replan_due = False
        self.replans += 1
        self.reserves = {i: max(peak for j, peak in self.smallest.items() if j > i)
                         for i in range(max(self.smallest))}
        self.runners = weakref.WeakKeyDictionary()  # shared frames' graphs planned again too
        self.compiled = self._compile()

    def plan_again(self) -> None:
        """Every graph planned again at its next run, from the graph Dynamo captured (no
        compile: Dynamo's graphs and guards stay)."""
        self.runners = weakref.WeakKeyDictionary()

    def _compile(self) -> Callable[..., Any]:
        """The model's forward compiled afresh (its own code object: a cache of its own)."""
        return torch.compile(_own_copy(self.model_forward), backend=backend, dynamic=None)

    def _ran(self, record: GraphRecord) -> None:
        self.step.append(record)  # the current call's list (a new one each call)

    @property
    def last(self) -> Optional[GraphRecord]:
        """The largest graph the latest call ran (what ``fxckpt.inspect(tm).plan`` shows)."""
        ran = self.step or self.records
        return max(ran, key=lambda r: r.plan.node_count, default=None)


GUARDS: dict[str, Any] = {
    "skip_nnmodule_hook_guards": False,  # a hook added or removed after the first call
    "allow_unspec_int_on_nn_module": True,  # a counter on the module: an input, not a recompile
    "use_numpy_random_stream": True,  # np.random draws from numpy, as the model does (a break)
}
"""Dynamo settings a training call runs under (its defaults favour inference). Floats stay
unspecialised, as torch.compile's default has them: a schedule's value is an input, not a
recompile per value. torch 2.13's Dynamo then formats such a float wrongly in an f-string after
a graph break (``f"{x.item():.5f}"`` appends the float itself from the second call on): a known
divergence of Python-side state, documented in the guide."""

UNPLANNED_WARNING = 0.25
"""The share of a forward's FLOPs outside planned graphs above which the driver warns (once)."""

MAX_REPLANS = 2
"""Times the step's graphs are planned again to keep room for a later graph, before a graph
that still cannot fit is refused."""

RECOMPILE_WARNING = 3
"""Calls in a row that compile a graph again before the driver warns (once)."""


def _own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own: Dynamo keeps compiled graphs (and counts recompiles)
    per code object, so each transformed module gets its own cache instead of sharing the model
    class's with every other instance and every ``torch.compile`` of it."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    return functools.update_wrapper(copy, fn)


def _device_of(model: torch.nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else str(first.device)

"""Which captured graph and which plan serve a call, made once and reused.

    call --CallKey--> Entry (one capture) --shapes, guards--> Compiled (one plan: rewritten graph)

A :class:`~fxckpt.signature.CallKey` (module modes, autocast, call structure, non-tensor values,
tensor dtypes/devices/ranks) selects the captures made for such calls; the first whose shapes
rule accepts the call's shapes (a ``symbolic_trace`` graph, or an exported graph with dynamic
dimensions, accepts any batch or sequence length) and whose guards hold serves it. The guards
(:mod:`fxckpt.capture.guards`) are the Python facts the graph depends on: the children,
parameters and buffers it calls and the attribute values the forward read. When one changed
(``model.temperature = 0.5``, a new head) the call captures again, and says so at INFO; a
capture whose children were replaced is dropped, and a fact that keeps changing is warned about
once. A capture serves one plan for every
shape, except under a memory budget, where the plan depends on sizes: which plan serves which
shapes (reuse of a larger one, power-of-two buckets for growing sizes, at most
:data:`~fxckpt.serve.plan_cache.MAX_PLANS` per capture) is
:mod:`fxckpt.serve.plan_cache`'s. Training with dynamic padding therefore costs one capture
and, under a budget, a few plans.

Captures do not depend on fxckpt's options, so transforms of the same model (comparing
strategies in a notebook, say) share them (:mod:`fxckpt.capture.sharing`), as long as the model
still holds the same modules, parameters and buffers; at most :data:`MAX_CAPTURES` per model
are kept for sharing. With ``capture="dynamo"`` a training call is Dynamo's instead
(:mod:`fxckpt.serve.dynamo`).

A training call to a Hugging Face model runs without a key/value cache (``use_cache=False``,
unless the caller passed it: :func:`fxckpt.integrations.without_cache`).

A training call that ``torch.compile`` traces gets budget plans of its own, fitted to the step
as compiled (:mod:`fxckpt.measure.compiled_step`; the lookup is a graph break, told so).

Capture and planning happen only when a training step needs them (``training`` with grad
enabled) or when asked (:meth:`Dispatcher.compiled_for`). The model's own forward serves ``eval()``
and ``torch.no_grad()`` unless the module runs as a pipeline of stages.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from fxckpt.config import TransformConfig
from fxckpt.errors import CaptureError, NotPlannedError, PlanError
from fxckpt import integrations
from fxckpt.capture.guards import Failure
from fxckpt.capture.sharing import fingerprint, offer, shared_capture
from fxckpt.cost.refined import refined
from fxckpt.plan import Plan
from fxckpt.serve.entry_planner import EntryPlanner, planning
from fxckpt.serve.plan_cache import PlanCache
from fxckpt.serve.refine import Refiner
from fxckpt.signature import CallKey, Shapes, call_key, dominates, module_states

if TYPE_CHECKING:  # the planner is imported when a call first needs it (start-up stays short)
    from fxckpt.capture.captured import Captured
    from fxckpt.serve.dynamo import DynamoDriver
    from fxckpt.serve.whole_graph import Compiled
    from fxckpt.runtime.offload import Offloader

__all__ = ["Dispatcher", "Entry", "MAX_CAPTURES", "RECAPTURE_WARNING"]

log = logging.getLogger(__name__)

MAX_CAPTURES = 16
"""Captures kept per transformed module; beyond it the oldest is dropped (with a warning)."""

RECAPTURE_WARNING = 3
"""Captures made again for one changed fact before the module warns that this is slow."""



@dataclasses.dataclass
class Entry:
    """One capture and the plans made on it, keyed by shapes (``None``: any shape)."""

    captured: Captured
    plans: PlanCache[Compiled] = dataclasses.field(default_factory=PlanCache)
    compiled_plans: PlanCache[Compiled] = dataclasses.field(default_factory=PlanCache)
    """Budget plans for training calls that ``torch.compile`` traces, fitted to that step."""


@dataclasses.dataclass
class Counts:
    """How often the module captured and planned (tests and benchmarks read these)."""

    captures: int = 0
    plans: int = 0
    capture_seconds: float = 0.0
    plan_seconds: float = 0.0


_SERVE_REASON = ("fxckpt picks the plan for each call outside the graph, one break before the "
                 "forward's first op: compile without fullgraph=True, or compile each block")


class Dispatcher:
    """The state behind a transformed module: its model, options, captures, plans and offloader."""

    def __init__(self, model: torch.nn.Module, config: TransformConfig) -> None:
        self.model = model
        self.config = config
        self.entries: dict[CallKey, list[Entry]] = {}
        self.last: Optional[Compiled] = None
        self.counts = Counts()
        self.offloader = _make_offloader(config)
        self.takes_use_cache = integrations.takes_use_cache(model)
        self.said_cache = False
        self.recaptures: dict[str, int] = {}
        """Captures made again because a fact changed, per fact (see :mod:`fxckpt.capture.guards`).
        """
        self.compiled_call: Optional[Callable[..., Any]] = None
        """``tm.compile()``'s compiled call (see :meth:`TransformedModule.compile`)."""
        self.switches: Optional[list[torch.nn.Module]] = None
        """The modules with a gradient-checkpointing flag of their own, looked at before each
        call through Dynamo (:func:`fxckpt.integrations.checkpointing_switches`)."""
        self.dynamo: Optional[DynamoDriver] = None
        """The Dynamo-compiled training forward (``capture="dynamo"``), made at the first call."""
        self.refiner = self._refiner()
        """Refines the plans' prices from the segment times of the first training steps."""

    def runs_model_itself(self, training: bool) -> bool:
        """True when a call runs the model's own forward (eval / no_grad, no pipeline stages)."""
        return not self.config.pipelined and not (training and torch.is_grad_enabled())

    def step_kwargs(self, tm: torch.nn.Module, kwargs: dict) -> dict:
        """``kwargs`` as a training call runs them: without a key/value cache for a Hugging Face
        model (:func:`fxckpt.integrations.without_cache`, said once at INFO)."""
        if not (self.takes_use_cache and tm.training):
            return kwargs
        announce = not self.said_cache and not torch.compiler.is_compiling()  # no log in a graph
        changed = integrations.without_cache(self.model, kwargs, announce=announce)
        if changed is None:
            return kwargs
        self.said_cache = True
        return changed

    def __call__(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        kwargs = self.step_kwargs(tm, kwargs)
        if torch.compiler.is_compiling():  # never timed or refined inside a compiled region
            return self._call(tm, args, kwargs)
        with self.refiner.call(tm.training and torch.is_grad_enabled()) as seen:
            return seen(self._call(tm, args, kwargs))

    def _call(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.trains_through_dynamo(tm):
            return self._through_dynamo(tm, args, kwargs)
        # Constant while dynamo traces this frame: the lookup after it (a graph break) is told.
        compiled = self.serve(tm, args, kwargs, torch.compiler.is_compiling())
        offloader = self.offloader
        training = tm.training and torch.is_grad_enabled()
        if offloader is None or self.config.offload == "auto" or not training:
            return compiled(args, kwargs)
        with offloader.hooks(tm):
            return compiled(args, kwargs)

    def trains_through_dynamo(self, tm: torch.nn.Module) -> bool:
        """Whether this training call goes through Dynamo: always with ``capture="dynamo"``;
        with ``auto`` unless an option needs one whole graph, a whole-graph plan was made before
        the first training call (``example_inputs=``, ``inspect(tm).plan_for``), or the model
        is sharded with FSDP2 (whose hooks Dynamo skips)."""
        capture = self.config.capture
        if capture == "dynamo" or self.dynamo is not None:
            return True
        if capture != "auto" or self.config.whole_graph_needed or self.entries:
            return False
        from fxckpt.serve.dynamo import sharded

        return not sharded(tm)

    @torch.compiler.disable(reason=_SERVE_REASON)
    def serve(self, tm: torch.nn.Module, args: tuple, kwargs: dict,
              under_compile: bool = False) -> Compiled:
        """The plan that runs this call on one whole graph (captured and planned now if needed;
        under a budget its unmodified step verified on the graph fits, it has no segment).
        ``under_compile``: the call is traced by ``torch.compile``; a training call under a
        budget gets a plan fitted to the compiled step.

        ``torch.compile`` does not trace this lookup (one graph break, before any segment): it
        runs Python over dicts and may capture or plan, and its result, a different object for
        each mode, autocast state and call structure, is what the compiled graph is guarded on.
        """
        compiled = self._lookup(tm, args, kwargs, under_compile)
        self.last = compiled
        if self.offloader is not None and tm.training and torch.is_grad_enabled():
            self.offloader.stats = type(self.offloader.stats)()
        return compiled

    def _through_dynamo(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """A training call compiled by Dynamo, each of its graphs planned
        (:mod:`fxckpt.serve.dynamo`). An outer ``torch.compile(tm)`` breaks its graph here: the
        driver runs uncompiled by it, and says so once."""
        return self._driven(tm, args, kwargs, torch.compiler.is_compiling())

    @torch._dynamo.disable
    def _driven(self, tm: torch.nn.Module, args: tuple, kwargs: dict, outer: bool) -> Any:
        if self.switches is None:
            self.switches = integrations.checkpointing_switches(self.model)
        if integrations.own_checkpointing_on(self.switches):  # switched on behind fxckpt's back
            integrations.release_own_checkpointing(self.model)
        if self.dynamo is None:
            from fxckpt.serve.dynamo import DynamoDriver, refuse_fsdp

            refuse_fsdp(tm)
            self.dynamo = DynamoDriver(self.model, self.config, self.offloader, self.counts)
        if outer:
            self.dynamo.inside_outer_compile(tm)
        out = self.dynamo(tm, args, kwargs)
        self.last = self.dynamo.last  # type: ignore[assignment]
        return out

    def compiled_for(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> Compiled:
        """The compiled plan for these inputs in ``tm``'s current mode, made now if needed."""
        if self.config.capture == "dynamo":
            raise NotPlannedError(
                "capture='dynamo' plans each graph when Dynamo compiles it, at the first training "
                "call, and cannot plan without running one: call the module in training (or "
                "plan with capture='auto')")
        with refined(self.refiner.factor):  # at the prices the training steps refined
            compiled = self._lookup(tm, args, self.step_kwargs(tm, kwargs))
        self.last = compiled
        return compiled

    def forget(self) -> None:
        """Drop every capture and plan (after ``.to()`` / ``.half()`` replaced the tensors), and
        what was measured of the steps (the device or dtype they ran at may have changed)."""
        self.entries.clear()
        self.last = None
        self.refiner = self._refiner()

    def _refiner(self) -> Refiner:
        return Refiner(self.config, self.model, self._replan, self._latest_plans)

    def _replan(self) -> None:
        """Every plan made again at its next call (captures kept): the prices were refined."""
        for entries in self.entries.values():
            for entry in entries:
                entry.plans = PlanCache()
        if self.dynamo is not None:
            self.dynamo.plan_again()

    def _latest_plans(self) -> list[Plan]:
        """The plans the latest call ran (each graph's, through Dynamo)."""
        if self.dynamo is not None:
            return [r.plan for r in self.dynamo.step]
        return [] if self.last is None else [self.last.plan]

    def compiled(self) -> list[Compiled]:
        """Every plan made so far, oldest first."""
        if self.dynamo is not None:
            return list(self.dynamo.records)  # type: ignore[arg-type]
        return self.whole_graphs()

    def whole_graphs(self) -> list[Compiled]:
        """Every plan made on one whole graph of the model, oldest first (what ``save``
        writes; a module that trains through Dynamo makes them for ``save`` and ``plan_for``)."""
        every = [c for entries in self.entries.values() for e in entries for c in e.plans.values()]
        return list({id(c): c for c in every}.values())  # one plan may serve several sizes

    def _keyed(self, tm: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[CallKey, Shapes]:
        """The call's key and shapes, as planned (the first micro-batch's)."""
        from fxckpt.serve.whole_graph import first_micro_batch

        return call_key(module_states(tm), *first_micro_batch(self.config, args, kwargs))

    def _lookup(self, tm: torch.nn.Module, args: tuple, kwargs: dict,
                under_compile: bool = False) -> Compiled:
        """The compiled plan for this call as it comes (captured and planned if needed)."""
        key, shapes = self._keyed(tm, args, kwargs)
        try:
            entry = self._entry(tm, key, shapes, args, kwargs)
            return self._plan(tm, key, entry, shapes, args, kwargs, under_compile)
        except (CaptureError, PlanError):
            from fxckpt.capture.own_error import own_error

            own = own_error(_view(tm, self.model), args, kwargs)
            if own is not None:
                raise own from None  # what the model itself raises for this call, unchanged
            raise

    def _entry(
        self, tm: torch.nn.Module, key: CallKey, shapes: Shapes, args: tuple, kwargs: dict
    ) -> Entry:
        from fxckpt.serve.whole_graph import capture_for

        entries = self.entries.setdefault(key, [])
        for entry in list(entries):
            if entry.captured.accepts(shapes):
                failure = entry.captured.guards.failure()
                if failure is None:
                    return entry
                self._stale(entries, entry, failure)
        if sum(len(e) for e in self.entries.values()) >= MAX_CAPTURES:
            oldest = next(k for k, v in self.entries.items() if v)
            log.warning(
                "fxckpt: %d captures made; dropping the oldest (do modes, dtypes or non-tensor "
                "arguments change every step?)",
                MAX_CAPTURES,
            )
            self.entries[oldest].pop(0)
        start = time.perf_counter()
        seen = fingerprint(tm)
        captured = shared_capture(self.model, key, shapes, seen, self.config.graph_method)
        if captured is None:
            integrations.release_own_checkpointing(self.model)  # switched on behind fxckpt's back
            with planning():
                captured = capture_for(_view(tm, self.model), self.config, args, kwargs, live=tm)
            self.counts.captures += 1
            self.counts.capture_seconds += time.perf_counter() - start
            offer(self.model, key, seen, captured, MAX_CAPTURES)
        entry = Entry(captured)
        entries.append(entry)
        return entry

    def _stale(self, entries: list[Entry], entry: Entry, failure: Failure) -> None:
        """A capture whose guard failed: dropped if it can never serve again, and said."""
        if failure.structural:
            entries.remove(entry)
        seen = self.recaptures[failure.fact] = self.recaptures.get(failure.fact, 0) + 1
        log.info("%s: %s; capturing again", type(self.model).__name__, failure)
        if seen == RECAPTURE_WARNING:
            log.warning(
                "fxckpt: %s of %s has changed %d times, and each change captures and plans the "
                "model again, which is slow. A value that changes every step belongs in a "
                "buffer: register it once (self.register_buffer('name', torch.tensor(value))) "
                "and update it in place (self.name.fill_(value)); fxckpt replays buffers every "
                "call", failure.fact, type(self.model).__name__, seen)

    def _plan(self, tm: torch.nn.Module, key: CallKey, entry: Entry, shapes: Shapes,
              args: tuple, kwargs: dict, under_compile: bool = False) -> Compiled:
        plan_key = shapes if self._shape_dependent(entry) else None
        fitted = (under_compile and self.config.budget is not None and not self.config.pipelined
                  and tm.training and torch.is_grad_enabled())
        plans = entry.compiled_plans if fitted else entry.plans
        compiled = plans.find(plan_key)
        if compiled is not None:
            return compiled
        if self.config.pipelined or self.config.budget is None or fitted:
            plans.buckets = False  # a compiled step's peak is checked at the call's own sizes
        larger = plan_key is not None and any(
            s is not None and dominates(s, plan_key)
            for e in self.entries.get(key, ()) for s in e.plans.plans)
        start = time.perf_counter()
        compiled, made = plans.make(plan_key, args, kwargs,
                                    EntryPlanner(lambda a, k: self._keyed(tm, a, k)[1],
                                                 self.config, self.offloader, tm,
                                                 entry.captured, fitted),
                                    planned_larger=larger)
        self.counts.plans += made
        self.counts.plan_seconds += time.perf_counter() - start
        return compiled

    def _shape_dependent(self, entry: Entry) -> bool:
        """Plans differ by shape only under a budget, or when the graph itself is shape-bound."""
        return self.config.budget is not None or not entry.captured.shape_free


def _view(tm: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """An instance of the model's class over ``tm``'s current state, to capture (never ``tm``)."""
    view = object.__new__(type(model))  # not type(model).__new__: FSDPModule.__new__ builds anew
    view.__dict__.update(tm.__dict__)
    view.__dict__.pop("_compiled_call_impl", None)  # what tm.compile() compiled is tm's call
    return view


def _make_offloader(config: TransformConfig) -> Optional[Offloader]:
    if not config.offload:
        return None
    from fxckpt.runtime.offload import Offloader

    return Offloader(config.offload_device or "cpu", threshold=config.offload_threshold)

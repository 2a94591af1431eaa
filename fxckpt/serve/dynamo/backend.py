"""One Dynamo graph planned by fxckpt's passes and run by its runtime.

Dynamo hands a backend each graph it captured with the real tensors of the call that made it:
the inputs, and (modules inlined) every parameter and buffer the graph reads, as placeholders
named after their source (``L['self']._modules['fc']._parameters['weight']``). :func:`plan_graph`
annotates the graph on fake copies of them, selects and fits a plan as for a captured graph, and
lowers it; the result runs eagerly. Two things differ from a captured graph, both about state
the graph receives as inputs instead of attributes:

* parameters and buffers are placeholders: annotate counts them as state, not activations;
* a buffer written in place (BatchNorm's running statistics, a counter) is an input of the
  segments that read it, and a recompute must read what the first run read: each segment
  restores such inputs around its recompute (``SegmentModule.restored_inputs``), as it
  restores the buffers it owns in a captured graph.

Plans are verified by running the *graph* on fake tensors, never the user's forward: no user
Python meets a fake tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.fx

from fxckpt.budget import Budget
from fxckpt.config import TransformConfig
from fxckpt.cost.annotate import annotate, has_info, info
from fxckpt.errors import AfterBreakInfeasible, BudgetInfeasibleError, PlanError
from fxckpt.plan import Plan
from fxckpt.runtime.checkpoint import checkpoint
from fxckpt.runtime.segment import Offloading, SegmentModule
from fxckpt.strategy import Budgeted

__all__ = ["GraphRecord", "GraphRunner", "at_smallest", "concrete",
           "graph_peak", "plan_graph", "state_name"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(repr=False)
class GraphRecord:
    """One graph of the forward as Dynamo broke it, with fxckpt's plan for it."""

    index: int
    """Its place among the graphs the driver planned, in the order Dynamo compiled them."""
    gm: torch.fx.GraphModule
    """The lowered graph (segments called through ``fxckpt_checkpoint``)."""
    plan: Plan
    held_bytes: int
    """What the graph keeps alive for backward at its end (its saved tensors and outputs):
    memory later graphs of the step run beside, counted against their budget."""
    held_before: int = 0
    """What earlier graphs of the step held when this one was planned."""
    ended_by: tuple[str, ...] = ()
    """Why Dynamo ended this graph (its own words, first lines); empty for a forward's last."""
    pipeline: None = None  # what inspection reads of a plan's runner: graphs have no stages

    def __repr__(self) -> str:
        from fxckpt.plan import format_bytes

        ended = f", ended by: {'; '.join(self.ended_by)}" if self.ended_by else ""
        return (f"<Dynamo graph {self.index}: {self.plan.summary()}; keeps "
                f"{format_bytes(self.held_bytes)} for backward{ended}>")


class GraphRunner:
    """What Dynamo calls for a graph: notes it ran in this step, then runs the lowered graph
    (inside ``around()``: the driver's measure of what runs unplanned)."""

    def __init__(self, record: GraphRecord, ran: Callable[[GraphRecord], None],
                 around: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self.record = record
        self.ran = ran
        self.around = around

    def record_for(self, args: tuple) -> GraphRecord:
        """The plan a call with these inputs runs: this graph's one plan (a
        :class:`~fxckpt.serve.dynamo.sized.SizedRunner` chooses by size)."""
        return self.record

    def __call__(self, *args: Any) -> Any:
        record = self.record_for(args)
        self.ran(record)
        with self.around():
            return record.gm(*args)


def state_name(node: torch.fx.Node) -> Optional[str]:
    """The qualified name of the parameter or buffer a Dynamo placeholder stands for
    (``fc.weight``), from its source; ``None`` for an input of the call."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = source.name if source is not None and hasattr(source, "name") else None
    if not isinstance(name, str) or not ("._parameters[" in name or "._buffers[" in name):
        return None
    parts = [p.split("'")[1] for p in name.split("[") if p.count("'") >= 2]
    return ".".join(parts[1:])  # the first is the compiled frame's local: the module itself


def plan_graph(gm: torch.fx.GraphModule, inputs: list[Any], config: TransformConfig, *,
               device: str, held_before: int = 0, reserve: int = 0,
               offloader: Optional[Offloading] = None,
               eager: Optional[int] = None) -> tuple[Plan, torch.fx.GraphModule]:
    """Plan and lower one Dynamo graph for a training step (``held_before``: bytes earlier
    graphs of the step keep alive, taken off a budget in bytes; ``reserve``: bytes kept for
    later graphs of the step, taken off as well; ``eager``: the unmodified graph's verified peak
    at these inputs, when already measured)."""
    from fxckpt.planning.fit import Target, fit
    from fxckpt.planning.select import select
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {n.name: name for n in placeholders if (name := state_name(n)) is not None}
    inputs = concrete(inputs)
    _reentrant_as_eager(gm)
    annotate(gm, list(inputs), state=frozenset(state))
    written = {m for n in gm.graph.nodes if has_info(n) for m in info(n).mutates} & set(state)
    config = _budget_left(config, held_before + reserve)

    hooked = tensor_hooks(gm)

    def plan_at(target: Target) -> Plan:
        return select(gm, config, capture="dynamo", training=True, signature=_signature(inputs),
                      hooked=hooked, target=target)

    def verify(lowered: torch.fx.GraphModule) -> int:
        _restore_written_state(lowered, written)  # as it will run: the state it writes bound
        return graph_peak(lowered, inputs, device)

    checked = verify if config.verifies else None
    try:
        plan, lowered = fit(gm, plan_at, checked, solved=config.budget is not None,
                            eager=eager if checked is not None else None, offloader=offloader)
    except BudgetInfeasibleError as e:
        if config.budget is None or config.budget.fraction is None:
            if not held_before:
                if not reserve:
                    raise  # bytes are for the whole step: it cannot fit
                step = e.min_budget + reserve
                raise BudgetInfeasibleError(e.budget + reserve, step, (
                    f"budget {e.budget + reserve} bytes cannot be met: this graph's smallest "
                    f"peak is {e.min_budget} bytes and the graphs after its graph break need "
                    f"{reserve} bytes beside what it keeps for backward. Give budget >= {step}, "
                    "or remove the break (inspect(tm).graphs says why Dynamo broke the "
                    "forward)")) from None
            step = held_before + e.min_budget
            raise AfterBreakInfeasible(e.budget + held_before, step, (
                f"budget {e.budget + held_before} bytes cannot be met: this graph runs after a "
                f"graph break, beside the {held_before} bytes earlier graphs of the step keep for "
                f"backward (each planned as the budget allowed when it ran), and its smallest "
                f"peak is {e.min_budget} bytes. Give budget >= {step}, or remove the break "
                "(inspect(tm).graphs says why Dynamo broke the forward)"),
                graph_peak=e.min_budget) from None
        # a fraction is of each graph's own step: a small graph (a loss after a break) that
        # cannot reach it runs its smallest plan, and says so
        smallest = at_smallest(config, e.min_budget)
        plan, lowered = fit(gm, lambda t: select(gm, smallest, capture="dynamo",
                                                 training=True, signature=_signature(inputs),
                                                 hooked=hooked, target=t),
                            checked, solved=True, offloader=offloader)
        plan = dataclasses.replace(plan, notes=plan.notes + (
            f"this graph's smallest peak is {e.min_budget} bytes, over {config.budget} of its "
            "own unmodified step: planned at its smallest",))
    _restore_written_state(lowered, written)
    return plan, lowered


def graph_peak(gm: torch.fx.GraphModule, inputs: list[Any], device: str) -> int:
    """The verified peak of a training step of the lowered graph ``gm`` at these inputs (as
    :func:`concrete` makes them; run on fake tensors:
    :func:`fxckpt.measure.verify.fake_step_peak`)."""
    from fxckpt.measure.verify import fake_step_peak

    def run(a: tuple, k: dict) -> Any:
        return gm(*a)
    return fake_step_peak(gm, run, tuple(inputs), {}, device=device)


def at_smallest(config: TransformConfig, peak: int) -> TransformConfig:
    """``config`` with a budget of ``peak`` bytes: a graph's smallest peak, which fits it."""
    return dataclasses.replace(config, strategy=Budgeted(Budget(bytes=peak)))


def concrete(inputs: list[Any]) -> list[Any]:
    """A graph's example inputs as its passes run them: an earlier graph's output (which
    arrives with its autograd history) as a copy of a new leaf (not a leaf, nor a view of one:
    a graph may write it in place), and a symbolic int (a Python int
    Dynamo made an input, such as a queue pointer on the module) as the value this call has."""
    def one(i: Any) -> Any:
        if isinstance(i, torch.Tensor) and not i.is_leaf:  # written in place by some graphs
            return i.detach().requires_grad_().clone()
        if isinstance(i, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            hint = i.node.hint
            if hint is None:
                raise PlanError(
                    f"Dynamo handed fxckpt a graph input {i} with no value (a size known only at "
                    "run time): it cannot be planned")
            return hint
        return i
    return [one(i) for i in inputs]


def tensor_hooks(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The graph's ``tensor.register_hook`` calls (Dynamo makes each one op), by node, in words:
    they stay out of recompute segments, so each hook is registered once, on the tensor backward
    reaches, and fires once (recomputed, it would be registered on the recomputed tensor too)."""
    try:
        op = torch.ops.higher_order.register_hook
    except (AttributeError, RuntimeError):  # a torch whose Dynamo breaks the graph there instead
        return {}
    return {n.name: f"the tensor `{n.args[0]}` (register_hook in the forward)"
            for n in gm.graph.nodes if n.op == "call_function" and n.target is op}


def _reentrant_as_eager(gm: torch.fx.GraphModule) -> None:
    """The model's own ``checkpoint(..., use_reentrant=True)`` calls run as eager runs them
    (:mod:`fxckpt.runtime.user_checkpoint`), not as the non-reentrant op Dynamo made of them."""
    from fxckpt.runtime.user_checkpoint import reentrant

    hop = torch.ops.higher_order.tag_activation_checkpoint
    changed = False
    for n in gm.graph.nodes:
        # torch.utils.checkpoint's default (use_reentrant not given) is reentrant, with a warning
        if n.op == "call_function" and n.target is hop and n.kwargs.get(
                "use_reentrant", True) is not False:
            n.target = reentrant
            changed = True
    if changed:
        gm.recompile()


def _budget_left(config: TransformConfig, held: int) -> TransformConfig:
    """A budget in bytes is for the whole step: this graph gets what earlier ones leave."""
    budget = config.budget
    if budget is None or budget.bytes is None or not held:
        return config
    left = max(1, budget.bytes - held)
    return dataclasses.replace(config, strategy=Budgeted(Budget(bytes=left)))


def _restore_written_state(gm: torch.fx.GraphModule, written: set[str]) -> None:
    """Each segment restores, around its recompute, the state inputs (placeholders named in
    ``written``) some node of the graph writes in place (see the module docstring)."""
    if not written:
        return
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not checkpoint:
            continue
        segment = getattr(gm, str(n.args[0].target))
        if isinstance(segment, SegmentModule):
            segment.restored_inputs = tuple(
                i for i, a in enumerate(n.args[1:])
                if isinstance(a, torch.fx.Node) and a.name in written)


def _signature(inputs: list[Any]) -> str:
    from fxckpt.signature import describe_signature

    return describe_signature(tuple(i for i in inputs if not isinstance(i, torch.nn.Parameter)),
                              {})


def held_at_end(gm: torch.fx.GraphModule, inputs: list[Any]) -> int:
    """Bytes a forward of the lowered ``gm`` leaves alive for backward, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxckpt.measure.meta_run import fake_twin
    from fxckpt.measure.tracker import LiveTensorTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = [fake_twin(mode, i) if isinstance(i, torch.Tensor) else i for i in inputs]
        with LiveTensorTracker(fake=True) as tracker:
            out = gm(*fake)
            held = tracker.current_bytes
        del out
    return held


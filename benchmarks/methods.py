"""The methods the benchmark compares, each a function ``model -> (module to run, facts)``.

* ``unmodified``: the model itself (the baseline of every ratio).
* ``fxckpt``: ``fxckpt.transform(model, budget=b, example_inputs=..., loss_fn=...)`` (the
  model's loss, as a user who wants the budget to count it passes it); facts from
  ``fxckpt.inspect(tm).plan`` (the peak it states, ``plan.peak_bytes``: verified where
  verification ran; the simulator's ``predicted_peak``; eager peaks; budget in bytes), the wall
  time of ``transform`` and of the budget solver alone. ``b`` is a fraction (``float``) or, for
  rows matched to a peer, bytes (``int``).
* ``fxckpt_compiled``: the same transformed module under ``torch.compile`` (same backend as the
  ``compile`` peer, torch's default ``activation_memory_budget`` of 1.0, so the memory decisions
  are fxckpt's): what a user who compiles runs, and the like-for-like point against the
  ``compile`` peer. Only run with a peer's measured peak as its budget (``@compile b=0.5``).
* ``checkpoint_per_block``: every block's ``forward`` wrapped in
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
* ``checkpoint_sequential``: the blocks run through
  ``torch.utils.checkpoint.checkpoint_sequential`` with ``round(sqrt(n))`` segments (torch leaves
  the last segment un-checkpointed). Hugging Face blocks take extra arguments (attention mask,
  ...): the container of blocks is replaced by one module that closes over them, so the model's own
  loop calls it once.
* ``sac_ops`` / ``sac_megatron``: every block under ``checkpoint(..., use_reentrant=False,
  context_fn=...)`` with torch's selective-checkpoint contexts and an op policy: torchtitan's
  (save attention kernels and every other matmul) or Megatron-LM's selective recompute (recompute
  the attention core only); see :mod:`benchmarks.sac`. Only for models whose blocks hold
  attention (``ModelSpec.attention``); elsewhere the row says not applicable.
* ``compile``: ``torch.compile(model)`` with its default backend, inductor (what a user of
  ``torch.compile`` runs; on CPU it generates C++ kernels), and
  ``torch._functorch.config.activation_memory_budget = b`` (set before the first, compiling step).
  Debugging backends such as ``aot_eager_decomp_partition`` run the partitioned graph op by op,
  1.3-1.8x slower than eager here: a peer nobody trains with, so the benchmark does not use them.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from benchmarks.models import ModelSpec
from benchmarks.sac import POLICIES, wrap

__all__ = ["METHODS", "BUDGETED", "PEERS", "OURS", "MATCHED_ONLY", "COMPILED", "NotApplicable",
           "prepare", "solve_seconds",
           "COMPILE_BACKEND"]

METHODS = ("unmodified", "fxckpt", "fxckpt_compiled", "checkpoint_per_block",
           "checkpoint_sequential", "sac_ops", "sac_megatron", "compile")
"""Every method, in report order."""

PEERS = ("checkpoint_per_block", "checkpoint_sequential", "sac_ops", "sac_megatron", "compile")
"""The methods fxckpt is compared with (targets, ``fxckpt @peer`` rows, the Pareto plot)."""

BUDGETED = frozenset({"fxckpt", "compile"})
"""Methods run once per budget; the others once per model (but :data:`MATCHED_ONLY`)."""

OURS = ("fxckpt", "fxckpt_compiled")
"""fxckpt's methods: their points are the ones compared with the peers."""

MATCHED_ONLY = frozenset({"fxckpt_compiled"})
"""Methods run only with a peer's measured peak as their budget (never on the grid)."""

COMPILED = frozenset({"fxckpt_compiled", "compile"})
"""Methods whose step runs compiled: the live-tensor tracker cannot measure them."""

COMPILE_BACKEND = "inductor"
"""``torch.compile``'s default backend; ``BenchOptions.compile_backend`` changes it (tests)."""

Facts = dict[str, Any]


class NotApplicable(Exception):
    """The method cannot be applied to this model; the message says why."""


Budget = Union[float, int]
"""A fraction of the eager peak (``float``) or bytes (``int``, fxckpt only)."""


def prepare(
    method: str,
    model: nn.Module,
    inputs: tuple[Any, ...],
    spec: ModelSpec,
    budget: Optional[Budget],
    compile_backend: str = COMPILE_BACKEND,
    time_solver: bool = True,
    loss: Optional[Callable[[Any], Any]] = None,
) -> tuple[Callable[..., Any], Facts]:
    """The module to call with ``inputs`` under ``method``, and facts to report about it.

    ``time_solver``: for ``fxckpt``, also time the solver alone (captures the model once more).
    ``loss``: the step's loss of the output, handed to ``fxckpt`` as ``loss_fn`` (as a user who
    wants the budget to count the loss's tensors does).
    """
    if method == "unmodified":
        return model, {"detail": "the model as built (baseline)"}
    if method == "fxckpt":
        return _fxckpt(model, inputs, _need(budget, method), time_solver, loss)
    if method == "fxckpt_compiled":
        tm, facts = _fxckpt(model, inputs, _need(budget, method), time_solver, loss)
        compiled = _UnderMemoryBudget(torch.compile(tm, backend=compile_backend), 1.0)
        return compiled, dict(facts, detail=f"torch.compile(backend={compile_backend!r}) of the "
                                            f"transformed module: {facts['detail']}")
    if method == "checkpoint_per_block":
        return _per_block(model, spec)
    if method == "checkpoint_sequential":
        return _sequential(model, spec)
    if method in POLICIES:
        return _selective(model, spec, method)
    if method == "compile":
        return _compile(model, float(_need(budget, method)), compile_backend)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _need(budget: Optional[Budget], method: str) -> Budget:
    if budget is None:
        raise ValueError(f"method {method!r} needs a budget fraction (got None)")
    return budget


def _fxckpt(
    model: nn.Module, inputs: tuple[Any, ...], budget: Budget, time_solver: bool,
    loss: Optional[Callable[[Any], Any]],
) -> tuple[nn.Module, Facts]:
    import fxckpt

    loss_fn = None if loss is None else functools.partial(_loss_of_output, loss)
    start = time.perf_counter()
    tm = fxckpt.transform(model, budget=budget, example_inputs=inputs, loss_fn=loss_fn)
    plan_s = time.perf_counter() - start
    plan = fxckpt.inspect(tm).plan
    solve = (
        solve_seconds(model, inputs, [budget], repeats=1)[0] if time_solver else {"solve_s": None}
    )
    facts = {
        "predicted_peak": plan.predicted_peak,
        "verified_peak": plan.verified_peak,
        "plan_peak": plan.peak_bytes,  # the verified figure where there is one
        "eager_predicted": plan.eager_peak,  # the simulator's
        "eager_plan_peak": plan.eager_peak_bytes,  # verified, as the plan states it
        "budget_bytes": plan.budget_bytes,
        "plan_s": plan_s,
        "solve_s": solve["solve_s"],
        "segments": len(plan.segments),
        "capture": plan.capture,
        "recompute_flops_fraction": plan.recompute_flops / plan.total_flops
        if plan.total_flops
        else 0.0,
        "detail": f"{len(plan.segments)} segments, recomputes "
        f"{plan.recompute_flops / max(plan.total_flops, 1):.0%} of forward FLOPs",
    }
    return tm, facts


def _loss_of_output(loss: Callable[[Any], Any], output: Any, *args: Any, **kwargs: Any) -> Any:
    return loss(output)


def _blocks(model: nn.Module, spec: ModelSpec) -> tuple[nn.Module, str, list[nn.Module]]:
    parent_path, _, attr = spec.blocks.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    container = getattr(parent, attr)
    blocks = list(container.children())
    if not blocks:
        raise NotApplicable(f"{spec.blocks} holds no blocks")
    return parent, attr, blocks


def _per_block(model: nn.Module, spec: ModelSpec) -> tuple[nn.Module, Facts]:
    _, _, blocks = _blocks(model, spec)
    for block in blocks:  # an instance attribute shadows the class's forward; __call__ uses it
        block.forward = functools.partial(  # type: ignore[method-assign]
            checkpoint, block.forward, use_reentrant=False
        )
    return model, {"detail": f"{len(blocks)} blocks, each under checkpoint(use_reentrant=False)"}


def _selective(model: nn.Module, spec: ModelSpec, method: str) -> tuple[nn.Module, Facts]:
    if not spec.attention:
        raise NotApplicable(f"{method} is an attention policy and {spec.name}'s blocks hold no "
                            f"attention")
    _, _, blocks = _blocks(model, spec)
    for block in blocks:
        wrap(block, method)
    return model, {"detail": f"{len(blocks)} blocks, each under checkpoint(use_reentrant=False, "
                             f"context_fn=selective contexts of the {method} policy)"}


def _call_block(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], x: Any) -> Any:
    return block(x, *args, **kwargs)


class CheckpointedChain(nn.Module):
    """The blocks as one module: ``chain(x, *extra)`` runs ``checkpoint_sequential`` over
    ``block(x, *extra)`` for each block (the extra arguments are the same for every block)."""

    def __init__(self, blocks: list[nn.Module], segments: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.segments = segments

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        functions = [functools.partial(_call_block, b, args, kwargs) for b in self.blocks]
        return checkpoint_sequential(functions, self.segments, x, use_reentrant=False)


def _sequential(model: nn.Module, spec: ModelSpec) -> tuple[nn.Module, Facts]:
    parent, attr, blocks = _blocks(model, spec)
    segments = max(1, round(math.sqrt(len(blocks))))
    chain = CheckpointedChain(blocks, segments)
    setattr(parent, attr, nn.ModuleList([chain]) if spec.iterated else chain)
    return model, {
        "detail": f"{len(blocks)} blocks in {segments} segments (last one not checkpointed)",
        "segments": segments,
    }


class _UnderMemoryBudget:
    """Calls ``compiled`` with ``torch._functorch.config.activation_memory_budget = budget``.

    The partitioner reads the setting when it compiles, at the first call, not when
    ``torch.compile`` is called; a process that times two compiled modules by turns (fxckpt's
    and the ``compile`` peer's) needs each compiled under its own.
    """

    def __init__(self, compiled: Callable[..., Any], budget: float) -> None:
        self.compiled, self.budget = compiled, budget

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.compiled(*args, **kwargs)


def _compile(model: nn.Module, budget: float, backend: str) -> tuple[Callable[..., Any], Facts]:
    compiled = _UnderMemoryBudget(torch.compile(model, backend=backend), budget)
    return compiled, {
        "detail": f"torch.compile(backend={backend!r}), activation_memory_budget={budget}"
    }


def solve_seconds(model: nn.Module, inputs: tuple[Any, ...], budgets: list[Budget],
                  repeats: int = 1) -> list[Facts]:
    """Wall time of the budget solver alone (``fxckpt.solver.portfolio.solve_plan``, with the
    repeated blocks and the outputs the planner offers it, as ``transform`` runs it: per block
    alone for large graphs of repeated blocks, else the cheaper of that and the full search), per
    budget fraction, after capture and annotate.

    The budget in bytes (an ``int`` as given, a ``float`` as that fraction of the predicted eager
    peak, reserve included) is what the solver gets, as in ``transform``. Each timing gets a
    fresh ``Problem`` (the solver caches its index on it); the median of ``repeats`` solves is
    reported.
    """
    from fxckpt.cost.annotate import annotate
    from fxckpt.capture.captured import capture
    from fxckpt.cost.bridge import problem_of
    from fxckpt.capture.graphs import planned_nodes
    from fxckpt.planning.blocks import block_ranges
    from fxckpt.planning.keeps import choices

    captured = capture(model, inputs, {})
    annotate(captured.gm, captured.graph_args(inputs, {}))
    order = planned_nodes(captured.gm.graph)

    def make() -> tuple[Any, Any, Any]:
        problem = problem_of(captured.gm)
        return problem, choices(problem, order, {})[0], block_ranges(problem, order)

    return [_time_solve(make, b, repeats) for b in budgets]


def _time_solve(make: Callable[[], Any], budget: Budget, repeats: int) -> Facts:
    from fxckpt.solver import BudgetInfeasible, simulate
    from fxckpt.solver.portfolio import solve_plan

    problem, _, _ = make()
    limit = budget if isinstance(budget, int) else int(budget * simulate(problem, ()).peak_bytes)
    times, feasible = [], True
    for _ in range(repeats):
        problem, offered, blocks = make()
        start = time.perf_counter()
        try:
            solve_plan(problem, limit, blocks, offered, [])
        except BudgetInfeasible:
            feasible = False
        times.append(time.perf_counter() - start)
    return {"budget": budget, "ops": len(problem.ops), "solve_s": sorted(times)[len(times) // 2],
            "feasible": feasible}

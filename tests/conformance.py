"""Run one zoo case through fxckpt with each strategy and report what happened, as plain data.

Shared by ``tests/test_conformance.py`` (which asserts) and ``scripts/models_matrix.py`` (which
writes ``docs/models.md``). For each strategy the same model object is transformed again (so the
capture is made once and shared), model and reference are put back to the same state, and two
training steps run on both: outputs, every gradient and every buffer must be ``torch.equal``, and
every segment must run twice in a step (forward and recompute).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch

import fxckpt
from support import run_step
from zoo import ZooCase

STRATEGIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("every=2", {"every": 2}), ("depth", {}), ("budget=0.6", {"budget": 0.6}))


@dataclasses.dataclass
class Outcome:
    """One strategy on one case."""

    strategy: str
    segments: int = 0
    exact: bool = False
    recomputed: bool = False
    """Every segment ran twice in the first step (its forward and its recompute)."""
    differs: list[str] = dataclasses.field(default_factory=list)
    """What was not bit-identical (outputs, ``grad of x``, ``buffer y``)."""
    note: str = ""


@dataclasses.dataclass
class CaseResult:
    case: str
    family: str
    params: int
    capture: str = ""
    shapes: str = ""
    error: Optional[str] = None
    """``Type: first line`` of the error fxckpt raised, if it refused the model."""
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def run_case(case: ZooCase) -> CaseResult:
    start = time.perf_counter()
    model, reference = case.make(), case.make()
    result = CaseResult(case.name, case.family, sum(p.numel() for p in model.parameters()))
    torch.manual_seed(1)
    args, kwargs = case.inputs()
    state, ref_state = _snapshot(model), _snapshot(reference)
    for name, options in STRATEGIES:
        options = options or {"depth": case.depth}
        _restore(model, state)
        _restore(reference, ref_state)
        try:
            result.outcomes.append(_run(name, model, reference, options, args, kwargs, result))
        except fxckpt.FxckptError as e:
            lines = [line.strip() for line in str(e).strip().splitlines()]
            result.error = f"{type(e).__name__}: " + " ".join(lines[:3])
            break
    result.seconds = time.perf_counter() - start
    return result


def _run(name: str, model: torch.nn.Module, reference: torch.nn.Module, options: dict, args: tuple,
         kwargs: dict, result: CaseResult) -> Outcome:
    note = ""
    try:
        tm = fxckpt.transform(model, **options, example_inputs=args, example_kwargs=kwargs)
    except fxckpt.BudgetInfeasibleError as e:  # a tiny model: ask for the smallest feasible budget
        tm = fxckpt.transform(
            model, budget=e.min_budget, example_inputs=args, example_kwargs=kwargs
        )
        note = f"0.6 infeasible; min_budget {e.min_budget} B used"
    info = fxckpt.inspect(tm)
    result.capture = info.plan.capture
    captured = fxckpt.module.dispatcher_of(tm).last.captured
    result.shapes = "dynamic" if captured.shape_free else "fixed"
    calls = _count_calls(info)
    outcome = Outcome(name, segments=len(info.plan.segments), note=note)
    for step in range(2):
        got = run_step(tm, args, kwargs, seed=step)
        want = run_step(reference, args, kwargs, seed=step)
        outcome.differs += [f"step {step}: {d}" for d in _differences(got, want)]
        if step == 0:
            outcome.recomputed = bool(calls) and set(calls.values()) == {2}
    outcome.exact = not outcome.differs
    return outcome


def _count_calls(info: fxckpt.Inspection) -> dict[str, int]:
    calls: dict[str, int] = {}
    for seg in info.plan.segments:
        calls[seg.name] = 0
        sub = info.graph_module.get_submodule(seg.name)
        sub.register_forward_pre_hook(
            lambda m, a, name=seg.name: calls.__setitem__(name, calls[name] + 1)
        )
    return calls


def _differences(a: Any, b: Any) -> list[str]:
    out = []
    if len(a.out) != len(b.out) or any(not torch.equal(x, y) for x, y in zip(a.out, b.out)):
        out.append("outputs")
    for k in a.param_grads:
        x, y = a.param_grads[k], b.param_grads.get(k)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            out.append(f"grad of {k}")
    out += [f"buffer {k}" for k in a.buffers if not torch.equal(a.buffers[k], b.buffers[k])]
    return out


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def _restore(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            v.copy_(state[k])
    for p in model.parameters():
        p.grad = None

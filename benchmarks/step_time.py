"""The step time a plan predicts on the CPU, against the step measured on this machine.

    python -m benchmarks.step_time [--models mlp,gpt2,llama,bert,resnet] [--turns 7] [--out docs]

Plans for a CPU are priced in FLOP-equivalents at this machine's own prices
(:mod:`fxckpt.cost.cpu_table`, measured where the plan is made): a matmul, convolution or
attention call costs its FLOPs at the time per FLOP measured for its shapes, every other call a
price per byte it writes plus a price per call. The unit is the matmul rate the prices were
measured at. A step is predicted as

    step = forward x (1 + recompute share) + backward + segments x segment overhead

where the forward is the plan's graph priced node by node, and the backward the unmodified
step's backward priced call by call the same way (its aten calls seen by a dispatch mode during
one real backward). For each bench model this times the unmodified model and fxckpt's plans at
0.5 and 0.75 of its peak, and the plans the table (``device_profile="cpu"``, measured once on
the project's benchmark machine) gives at the same budgets, all paired by turns
(:func:`fxckpt.measure.time_by_turns`), one thread, and reports:

* the predicted and measured step, and their ratio;
* what the plan adds to the unmodified step, predicted and measured: the part of the step the
  plan's recompute decides, apart from how well the forward and backward are priced;
* the measured step of each plan against the table's plan at the same budget: what pricing
  with this machine's prices buys;
* the same prediction after the module refined its prices (:mod:`fxckpt.serve.refine`): each
  transformed module first runs the steps that time its segments and plan again, and the
  model's ops (forward and backward, not the fixed overheads) are predicted at the factor its
  plans measured (``inspect(tm).refinement.measured``, from a budget plan with segments);
* each step predicted from another module's first steps, as timed by its refinement: their
  forward and backward, less what that module's plan added, plus what this row's plan adds
  (``Refinement.step_seconds``; :data:`FROM` says whose steps predict which row).

Predictions, not targets: the first table says how far the prices are from the measured steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.calibrate import matmul_rate
from fxckpt.cost.cpu_table import uses_measured_prices
from benchmarks.models import MODEL_NAMES, spec_for
from benchmarks.report import machine_info
from fxckpt.serve.refine import TIMED, WARMUP

__all__ = ["Row", "measure", "render", "main"]

BUDGETS = (0.5, 0.75)

FROM = {"unmodified": "fxckpt 0.5", "fxckpt 0.5": "fxckpt 0.75", "fxckpt 0.75": "fxckpt 0.5"}
"""Whose timed first steps predict each row's step: never the row's own module."""

REFINE_STEPS = WARMUP + TIMED + 1
"""Steps each transformed module runs before the timed turns: the last of them plans again
with the refined prices, when the factor is past the tolerance."""


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    method: str
    segments: int
    recompute_share: float
    predicted_s: float
    measured_s: float
    """Median of the turns."""
    forward_s: float = 0.0
    """The predicted forward, recompute left out."""
    backward_s: float = 0.0
    """The predicted backward."""
    table_s: Optional[float] = None
    """Median of the same turns for the plan the table's prices give at this budget (``None``
    for the unmodified model, and when plans are priced with the table anyway)."""
    table_same: Optional[bool] = None
    """Whether the table's plan is this plan (same segments and kept nodes)."""
    table_segments: Optional[int] = None
    refined_s: Optional[float] = None
    """The predicted step with the model's ops at the factor its timed segments measured."""
    replanned: Optional[bool] = None
    """Whether the refinement made this plan again (``None``: not refined)."""
    changed: Optional[bool] = None
    """Whether the plan made again differs from the first."""
    factor: Optional[float] = None
    """The factor the model's timed segments measured (its ops at that times their prices)."""
    stepped_s: Optional[float] = None
    """The step predicted from another module's first steps (:data:`FROM`): their measured
    forward and backward, less what that module's plan added, plus what this plan adds, the
    recompute of both at its prices (:meth:`fxckpt.serve.refine.Refinement.step_seconds`)."""
    stepped_factor_s: Optional[float] = None
    """The same, the recompute of both at the factor the other module's segments measured."""

    @property
    def ratio(self) -> float:
        """Predicted over measured."""
        return self.predicted_s / self.measured_s


def _forward_cost(tm: torch.nn.Module) -> tuple[float, float]:
    """(one forward pass, one segment's overhead), in FLOP-equivalents as plans for this CPU
    are priced (measured here, or the table under ``FXCKPT_CPU_PRICES=table``), from the
    annotated graph of a module transformed with no strategy (no segment)."""
    from fxckpt.cost.bridge import priced_problem
    from fxckpt.module import dispatcher_of

    compiled = dispatcher_of(tm).last
    assert compiled is not None and not compiled.plan.segments
    problem = priced_problem(compiled.gm)
    return sum(op.cost for op in problem.ops), problem.segment_overhead


class _Backward(TorchDispatchMode):
    """Collects what the calls it sees cost beyond their FLOPs, as plans for this CPU price
    them: each call's key to be timed at its own layout where it can be made again, else its
    terms. Nothing is timed in here: under this mode and the FLOP counter a timing would
    measure them too."""

    def __init__(self) -> None:
        super().__init__()
        self.terms: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        from fxckpt.cost.prices import call_terms

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.terms += call_terms(func, args, kwargs, out,
                                 torch.Tag.nondeterministic_seeded in func.tags)
        return out


def backward_cost(model: torch.nn.Module, inputs: tuple[Any, ...],
                  loss: Callable[[Any], Any]) -> float:
    """One backward pass of the unmodified step, priced call by call as plans for this CPU are
    priced (FLOPs, and each call at the measured table), in FLOP-equivalents."""
    from fxckpt.cost.devices import profile_for
    from fxckpt.cost.flops import counter
    from fxckpt.cost.prices import TABLE

    profile = profile_for(None, torch.device("cpu"))
    table = profile.table if profile is not None and profile.table is not None else TABLE
    value = loss(model(*inputs))
    calls, flops = _Backward(), counter()
    with flops, calls:
        value.backward()
    model.zero_grad(set_to_none=True)
    return table.work(calls.terms) + flops.get_total_flops()


def unit() -> float:
    """FLOP-equivalents per second of the prices plans for this CPU are made with: the matmul
    rate the measured table was taken at, or this machine's for the table."""
    from fxckpt.cost.devices import profile_for

    profile = profile_for(None, torch.device("cpu"))
    return profile.unit if profile is not None else matmul_rate()


def measure(model_name: str, quick: bool = False, turns: int = 7,
            rate: Optional[float] = None) -> list[Row]:
    """The rows of one bench model (see the module docstring)."""
    import fxckpt
    from fxckpt.measure import time_by_turns, training_step

    spec = spec_for(model_name)
    torch.manual_seed(0)
    model, inputs, loss = spec.build(spec.quick if quick else spec.full)
    rate = rate if rate is not None else unit()
    forward, overhead = _forward_cost(fxckpt.transform(model, example_inputs=inputs))
    backward = backward_cost(model, inputs, loss)
    plans: dict[str, Any] = {"unmodified": None}
    modules: dict[str, Any] = {"unmodified": model}
    compare = uses_measured_prices()
    for budget in BUDGETS:
        tm = fxckpt.transform(model, budget=budget, example_inputs=inputs)
        plans[f"fxckpt {budget}"], modules[f"fxckpt {budget}"] = fxckpt.inspect(tm).plan, tm
        if compare:
            priced = fxckpt.transform(model, budget=budget, example_inputs=inputs,
                                      device_profile="cpu")
            plans[f"table {budget}"] = fxckpt.inspect(priced).plan
            modules[f"table {budget}"] = priced
    steps = {name: training_step(m, inputs, loss) for name, m in modules.items()}
    for name, step in steps.items():  # the steps that refine the prices, before any is timed
        for _ in range(REFINE_STEPS if name.startswith("fxckpt") else 1):
            step()
    refinements = {name: fxckpt.inspect(m).refinement for name, m in modules.items()
                   if name.startswith("fxckpt")}
    plans.update({name: fxckpt.inspect(modules[name]).plan for name in refinements})
    factor = next((r.measured for r in refinements.values() if r is not None and r.runs), None)
    samples = time_by_turns(steps, repeats=turns)
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    median = {name: statistics.median(times) for name, times in samples.items()}
    rows = []
    for name, plan in plans.items():
        if name.startswith("table"):
            continue
        segments = len(plan.segments) if plan is not None else 0
        share = (plan.recompute_share or 0.0) if plan is not None else 0.0
        ops = forward * (1 + share) + backward
        predicted = (ops + segments * overhead) / rate
        table = name.replace("fxckpt", "table") if plan is not None else ""
        refined = None if factor is None else (ops * factor + segments * overhead) / rate
        result, source = refinements.get(name), refinements.get(FROM.get(name, ""))
        stepped = (None, None) if source is None else (
            source.step_seconds(share, segments),
            source.step_seconds(share, segments, source.measured))
        rows.append(Row(model_name, name, segments, share, predicted, median[name],
                        forward / rate, backward / rate, median.get(table),
                        _same(plan, plans[table]) if table in plans else None,
                        len(plans[table].segments) if table in plans else None,
                        refined, None if result is None else result.replanned,
                        None if result is None else result.changed, factor, *stepped))
    return rows


def _same(plan: Any, other: Any) -> bool:
    return [(s.nodes, s.keeps) for s in plan.segments] == \
        [(s.nodes, s.keeps) for s in other.segments]


def render(rows: list[Row], facts: dict[str, Any]) -> str:
    lines = [
        "# Predicted against measured step time on the CPU",
        "",
        f"*Generated by `python -m benchmarks.step_time` in {facts['seconds']:.0f} s on "
        f"{facts['machine']}, torch {facts['torch']}, {facts['threads']} thread; prices "
        f"{facts.get('prices', 'measured here')}, in FLOP-equivalents at "
        f"{facts['rate'] / 1e9:.1f} GFLOP/s; medians of {facts['turns']} turns.* A step is "
        "predicted as forward x (1 + recompute share) + backward + segments x segment overhead, "
        "forward and backward priced call by call (`benchmarks/step_time.py`).",
        "",
        "| model | plan | segments | recompute | predicted step (forward, backward) | measured "
        "step | predicted / measured | added: predicted | added: measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r.model: r for r in rows if r.method == "unmodified"}
    for r in rows:
        b = base[r.model]
        added = ("—", "—") if r is b else (
            f"{(r.predicted_s - b.predicted_s) * 1e3:+.0f} ms",
            f"{(r.measured_s - b.measured_s) * 1e3:+.0f} ms")
        lines.append(
            f"| {r.model} | {r.method} | {r.segments} | {r.recompute_share:.0%} | "
            f"{r.predicted_s * 1e3:.0f} ms ({r.forward_s * 1e3:.0f}, {r.backward_s * 1e3:.0f}) | "
            f"{r.measured_s * 1e3:.0f} ms | {r.ratio:.2f} | {added[0]} | {added[1]} |")
    within, spread = _within([r.ratio for r in rows])
    lines += ["", f"{within} of {len(rows)} predicted steps are within 10% of the measured step "
              f"(predicted / measured {spread}).", ""]
    refined = [r for r in rows if r.refined_s is not None]
    if refined:
        lines += _after_refinement(refined)
    stepped = [r for r in rows if r.stepped_s is not None]
    if stepped:
        lines += _from_first_steps(stepped)
    compared = [r for r in rows if r.table_s is not None]
    if compared:
        lines += _against_table(compared)
    return "\n".join(lines)


def _within(ratios: list[float]) -> tuple[int, str]:
    """How many predicted / measured ratios are within 10% of 1, and their range as text."""
    return (sum(abs(x - 1) <= 0.10 for x in ratios),
            f"from {min(ratios):.2f} to {max(ratios):.2f}")


def _after_refinement(rows: list[Row]) -> list[str]:
    """The predictions again, the ops at the factor each model's timed segments measured."""
    lines = ["## After the first steps refined the prices", "",
             "Each transformed module ran the steps that time its segments "
             "(`fxckpt.serve.refine`) before the turns; its ops are predicted at the factor "
             "they measured, the fixed overheads as before. \"planned again\": the factor was "
             "past the 10% tolerance and the plan was made again with it (\"changed\": into "
             "another plan, the one timed).", "",
             "| model | plan | ops at | predicted step | measured step | predicted / measured | "
             "planned again |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        assert r.refined_s is not None
        again = {None: "—", True: "yes", False: "no"}[r.replanned]
        again += ", changed" if r.changed else ""
        lines.append(f"| {r.model} | {r.method} | x{r.factor:.2f} | {r.refined_s * 1e3:.0f} ms | "
                     f"{r.measured_s * 1e3:.0f} ms | {r.refined_s / r.measured_s:.2f} | {again} |")
    within, spread = _within([(r.refined_s or 0) / r.measured_s for r in rows])
    return lines + ["", f"{within} of {len(rows)} within 10% after refinement ({spread}).", ""]


def _from_first_steps(rows: list[Row]) -> list[str]:
    """Each step predicted from another module's timed first steps (:data:`FROM`)."""
    lines = ["## From another plan's first steps", "",
             "`inspect(tm).refinement` of a transformed module times its first steps' forward "
             "and backward, and takes off what its plan adds (its recompute and each segment's "
             "overhead, as priced) to predict the step of any other plan of the model: that "
             "plan's additions on top (`Refinement.step_seconds`). Each row is predicted from "
             "the other module's steps, never its own: the unmodified step and the 0.75 plan "
             "from the 0.5 module, the 0.5 plan from the 0.75 module. The last column puts "
             "the recompute of both plans at the factor the other module's segments measured "
             "instead of at its prices.", "",
             "| model | plan | predicted from | predicted step | measured step | "
             "predicted / measured | at the measured factor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        assert r.stepped_s is not None and r.stepped_factor_s is not None
        lines.append(f"| {r.model} | {r.method} | {FROM[r.method]} | {r.stepped_s * 1e3:.0f} ms "
                     f"| {r.measured_s * 1e3:.0f} ms | {r.stepped_s / r.measured_s:.2f} | "
                     f"{r.stepped_factor_s / r.measured_s:.2f} |")
    summary = []
    for name, values in (("at the prices", [r.stepped_s or 0 for r in rows]),
                         ("at the measured factor", [r.stepped_factor_s or 0 for r in rows])):
        within, spread = _within([v / r.measured_s for v, r in zip(values, rows)])
        summary.append(f"{name}, {within} of {len(rows)} within 10% ({spread})")
    return lines + ["", "Recompute " + "; ".join(summary) + ".", ""]


def _against_table(rows: list[Row]) -> list[str]:
    """The plans priced here against the table's plans at the same budgets."""
    lines = ["## This machine's prices against the table's", "",
             "The same budgets planned with the table (`device_profile=\"cpu\"`), timed in the "
             "same turns: a ratio under 1 is a faster step for pricing with what this machine "
             "measures. Where both price lists give the same plan, the ratio is the timing noise.",
             "",
             "| model | budget | segments: here (table) | same plan | step / table plan's step |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.method.split()[-1]} | {r.segments} ({r.table_segments}) | "
                     f"{'yes' if r.table_same else 'no'} | "
                     f"{r.measured_s / (r.table_s or 1):.3f} |")
    differ = [r.measured_s / r.table_s for r in rows if not r.table_same and r.table_s]
    if differ:
        lines += ["", f"Where the plans differ ({len(differ)} of {len(rows)}): from "
                  f"{min(differ):.3f} to {max(differ):.3f}, median "
                  f"{statistics.median(differ):.3f}.", ""]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_time",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES))
    p.add_argument("--turns", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="the bench's tiny sizes")
    p.add_argument("--out", type=Path, default=None, help="write step_time.md there")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rate = unit()
    rows = [row for name in args.models.split(",")
            for row in measure(name, args.quick, args.turns, rate)]
    machine = machine_info()
    facts = {"seconds": time.perf_counter() - start, "rate": rate, "turns": args.turns,
             "threads": args.threads, "torch": torch.__version__,
             "machine": f"{machine['cpu']} ({machine['cores']} cores)",
             "prices": "measured here" if uses_measured_prices() else "the table's"}
    text = render(rows, facts)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_time.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

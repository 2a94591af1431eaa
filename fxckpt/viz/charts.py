"""``fxckpt.plot_pareto`` (memory vs recompute) and ``plot_schedule`` (the pipeline as a Gantt
chart).

Pareto: each point is the plan the budget solver picks for one budget, placed by predicted peak
(simulated, plus the reserve for backward temporaries: ``Plan.predicted_peak``) and recompute
cost as a share of one forward pass (``Plan.recompute_share``). Plans of transformed modules are
marked at the same two figures their summary prints, so "is my every=2 plan far from the curve?"
has a visible answer; a plan with a verified peak also gets a hollow mark there.

Schedule: GPipe's fill-drain clock, forward then backward, one row per stage::

    stage 0 | F0 F1 F2 F3 .  .  |  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  |  .  B3 B2 B1 B0 .      hatched B = recompute, then backward

Backward runs the forward pattern in reverse; a micro-batch below ``checkpoint_stop`` recomputes
its stage right before its backward (``always``: all; ``except_last``: all but the last).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from fxckpt.plan import Plan
from fxckpt.viz.common import PathLike, finish, inspect_module, memory_unit, new_figure

__all__ = ["plot_pareto", "plot_schedule", "schedule_bars"]


def plot_pareto(
    model: Any,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Optional[Mapping[str, Any]] = None,
    *,
    points: int = 9,
    mark: Optional[Mapping[str, Any]] = None,
    path: Optional[PathLike] = None,
) -> Any:
    """Draw the predicted trade-off between peak activation memory and recompute for ``model``.

    Args:
        model: the plain ``nn.Module`` (in the mode to plan for), as for :func:`fxckpt.pareto`.
        example_inputs, example_kwargs: the inputs to plan with.
        points: budgets to solve for, from the smallest feasible peak to the eager peak.
        mark: ``{"label": transformed_module}`` plans to mark on the curve.
        path: also save the picture there.
    """
    from fxckpt.planning.pareto import pareto

    curve = pareto(
        model,
        example_inputs=tuple(example_inputs),
        example_kwargs=dict(example_kwargs or {}),
        points=points,
    )
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot()
    eager = curve[0]["eager_peak"] if curve else 0
    unit, scale = memory_unit(max([eager, *(p["predicted_peak"] for p in curve)], default=1))
    ax.plot(
        [p["predicted_peak"] / scale for p in curve],
        [100 * p["recompute"] for p in curve],
        marker="o",
        color="C0",
        label=f"budget solver ({len(curve)} budgets)",
        gid="pareto",
    )
    ax.scatter(
        [eager / scale],
        [0],
        marker="*",
        s=120,
        color="#444444",
        zorder=3,
        label="no checkpointing",
    )
    for i, (label, module) in enumerate((mark or {}).items()):
        plan = inspect_module(module).plan
        peak, recompute = _plan_point(module)
        ax.scatter(
            [peak / scale],
            [100 * recompute],
            marker="D",
            s=max(90 - 25 * i, 20),
            color=f"C{(i + 1) % 10}",
            zorder=4 + i,
            label=label,
            gid=f"mark:{label}",
        )  # later marks smaller and on top: equal plans stay visible
        if plan.verified_peak is not None:
            ax.scatter([plan.verified_peak / scale], [100 * recompute], marker="D", s=40,
                       facecolors="none", edgecolors=f"C{(i + 1) % 10}", zorder=4 + i,
                       label=f"{label}, verified peak", gid=f"verified:{label}")
    ax.set_xlabel(f"predicted peak activation memory ({unit}): simulated + reserve")
    ax.set_ylabel("recompute (% of one forward pass, estimated time)")
    ax.set_title(f"Memory / recompute trade-off: {type(model).__name__}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return finish(fig, path)


def _plan_point(module: Any) -> tuple[float, float]:
    """A transformed (or loaded) module's plan in the curve's units: ``(Plan.predicted_peak,
    Plan.recompute_share)``, the figures its summary prints (worked out again for plans saved
    before they were kept)."""
    from fxckpt.cost.bridge import to_problem
    from fxckpt.cost.prediction import predict_spans, recompute_share
    from fxckpt.cost.runs import keep_positions, spans_of

    seen = inspect_module(module)
    plan = seen.plan
    if plan.predicted_peak is not None and plan.recompute_share is not None:
        return plan.predicted_peak, plan.recompute_share
    problem = to_problem(seen.view)
    ranges = spans_of(problem, [s.nodes for s in plan.segments])
    keep = keep_positions(problem, [k for s in plan.segments for k in s.keeps])
    return predict_spans(problem, ranges, keep).peak, recompute_share(problem, ranges, keep)


def schedule_bars(chunks: int, stages: int, checkpoint: str) -> list[tuple[str, int, int, bool]]:
    """Every bar of the chart, ``(phase, micro-batch, stage, recomputed)``; ``_clock`` places it.
    """
    from fxckpt.runtime.schedule import checkpoint_stop

    stop = checkpoint_stop(chunks, checkpoint)
    bars = [("forward", i, j, False) for i in range(chunks) for j in range(stages)]
    bars += [("backward", i, j, i < stop) for i in range(chunks) for j in range(stages)]
    return bars


def _clock(phase: str, i: int, j: int, chunks: int, stages: int) -> int:
    clocks = chunks + stages - 1
    if phase == "forward":
        return i + j
    return clocks + (chunks - 1 - i) + (stages - 1 - j)


def plot_schedule(module_or_plan: Any, path: Optional[PathLike] = None) -> Any:
    """Draw a staged plan's pipeline schedule (forward, recompute, backward) as a Gantt chart."""
    plan = (
        module_or_plan if isinstance(module_or_plan, Plan) else inspect_module(module_or_plan).plan
    )
    view = plan.pipeline
    if view is None:
        raise ValueError("this plan has no pipeline stages; transform with chunks= and devices= "
                         "to get a schedule")
    chunks, stages = view.chunks, len(view.stages)
    fig = new_figure(min(16.0, 4 + 0.5 * 2 * (chunks + stages)), 1.2 + 0.5 * stages)
    ax = fig.add_subplot()
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    for phase, i, j, recomputed in schedule_bars(chunks, stages, view.checkpoint):
        x = _clock(phase, i, j, chunks, stages)
        ax.barh(
            j,
            0.92,
            left=x,
            height=0.7,
            color=cmap(i % 10),
            alpha=1.0 if phase == "forward" else 0.55,
            hatch="///" if recomputed else None,
            edgecolor="#333333",
            linewidth=0.5,
            gid=f"{phase}:{i}:{j}",
        )
        ax.text(
            x + 0.46,
            j,
            f"{'F' if phase == 'forward' else 'B'}{i}",
            ha="center",
            va="center",
            fontsize=7,
        )
    clocks = chunks + stages - 1
    ax.axvline(clocks - 0.04, color="#555555", linewidth=0.8)
    ax.set_yticks(range(stages), [f"stage {s.stage} ({s.device})" for s in view.stages])
    ax.invert_yaxis()
    ax.set_xlabel("clock (forward | backward); hatched: recomputed before its backward")
    ax.set_xlim(-0.2, 2 * clocks + 0.2)
    ax.set_title(f"GPipe schedule: {chunks} micro-batch(es) x {stages} stage(s), checkpoint="
                 f"{view.checkpoint}, bubble {view.bubble:.0%}", fontsize=9)
    return finish(fig, path)

"""``fxckpt.plot_memory``: live activation memory over one training step, predicted and measured.

The curves are the simulator's (:func:`fxckpt.solver.simulate.simulate`) on the graph the plan
was made on, event by event, and are labelled "simulated"; the title and the dotted line give the
plan's own peak (``Plan.peak_bytes``: the simulated peak plus a reserve for backward temporaries,
or the verified figure), the number its summary prints. The events::

    forward op 0 .. op n-1 | backward start | (recompute segment) backward ops ... op 0

With ``inputs=``, a real step is measured op by op (:mod:`fxckpt.measure.timeline`) and drawn over
it. The two have different clocks (one event per graph node vs one per aten op), so the measured
curve is stretched phase by phase: its forward ops over the predicted forward, its backward ops
over the predicted backward. Peaks and shapes are comparable; op-to-op alignment is not.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from fxckpt.viz.common import PathLike, finish, inspect_module, memory_unit, new_figure

__all__ = ["plot_memory", "predicted_timelines"]


def predicted_timelines(module: Any) -> tuple[Any, Any, int]:
    """``(plan simulation, no-checkpoint simulation, reserve bytes)`` of ``module``'s latest plan.
    """
    sim, eager, reserve, _ = _timelines(module)
    return sim, eager, reserve


def _timelines(module: Any) -> tuple[Any, Any, int, list[int]]:
    """:func:`predicted_timelines` and the bytes of kept outputs (selective) at each event."""
    from fxckpt.cost.bridge import to_problem
    from fxckpt.cost.runs import keep_positions, spans_of
    from fxckpt.solver.simulate import kept_live, simulate

    seen = inspect_module(module)
    problem = to_problem(seen.view)
    ranges = spans_of(problem, [seg.nodes for seg in seen.plan.segments])
    keep = keep_positions(problem, [k for seg in seen.plan.segments for k in seg.keeps])
    sim = simulate(problem, ranges, keep)
    return sim, simulate(problem, ()), sim.reserve_bytes, kept_live(problem, ranges, keep)


def plot_memory(
    module: Any,
    path: Optional[PathLike] = None,
    *,
    inputs: Optional[Sequence[Any]] = None,
    kwargs: Optional[Mapping[str, Any]] = None,
    loss: Optional[Callable[[Any], Any]] = None,
    eager: bool = True,
) -> Any:
    """Draw predicted live activation memory over a training step of ``module``'s latest plan.

    Args:
        module: a module from ``fxckpt.transform`` (planned) or ``fxckpt.load``.
        path: also save the picture there.
        inputs, kwargs: run one training step with these inputs and draw its measured memory too
            (the module's gradients, buffers and RNG state are put back afterwards).
        loss: the loss of the measured step (default: sum of squares of the floating outputs).
        eager: also draw the prediction without checkpointing.
    """
    measured = None
    if inputs is not None or kwargs is not None:
        from fxckpt.measure.timeline import measure_step

        measured = measure_step(module, tuple(inputs or ()), dict(kwargs or {}), loss)
    plan = inspect_module(module).plan
    sim, eager_sim, reserve, kept = _timelines(module)
    fig = new_figure(10, 4.2)
    ax = fig.add_subplot()
    peak = max(
        [
            sim.peak_bytes,
            eager_sim.peak_bytes if eager else 0,
            measured.peak_bytes if measured else 0,
            plan.peak_bytes or 0,
        ]
    )
    unit, scale = memory_unit(peak)
    n_forward = sum(1 for event, _ in sim.timeline if event.startswith("forward"))
    _phases(ax, sim.timeline, n_forward)
    _curve(ax, sim.timeline, scale, "simulated, this plan", "C0", "-", 1.6)
    if any(kept):
        ax.fill_between(range(len(kept)), [k / scale for k in kept], color="C1", alpha=0.35,
                        linewidth=0, label="of which kept outputs (selective recompute)",
                        gid="kept")
    if eager:
        _curve(ax, eager_sim.timeline, scale, "simulated, no checkpointing", "#7f7f7f", "--", 1.0)
    _plan_peaks(ax, plan, reserve, scale)
    if measured is not None:
        _measured(ax, measured, n_forward, len(sim.timeline), scale)
    _mark_peak(ax, sim.timeline, scale)
    _labels(ax, plan, unit)
    return finish(fig, path)


def _plan_peaks(ax: Any, plan: Any, reserve: int, scale: float) -> None:
    """Lines at the plan's own peaks: predicted (simulated + reserve) and verified."""
    if plan.predicted_peak:
        ax.axhline(plan.predicted_peak / scale, color="C0", linestyle=":", linewidth=1,
                   label=f"plan's predicted peak (simulated + {_fmt(reserve)} reserve for "
                         "backward temporaries)", gid="predicted_peak")
    if plan.verified_peak is not None:
        ax.axhline(plan.verified_peak / scale, color="C2", linestyle="-.", linewidth=1,
                   label="plan's verified peak (run on fake tensors)", gid="verified_peak")


def _labels(ax: Any, plan: Any, unit: str) -> None:
    """The title states the plan's peaks as its summary does (``Plan.peak_bytes``)."""
    staged = " (one micro-batch)" if plan.micro_batched else ""
    kind = "verified" if plan.verified_peak is not None else "predicted"
    peaks = ""
    if plan.peak_bytes is not None and plan.eager_peak_bytes is not None:
        peaks = (f"; {kind} peak {_fmt(plan.peak_bytes)} vs {_fmt(plan.eager_peak_bytes)} "
                 "eager")
    ax.set_title(
        f"Activation memory over one training step{staged}: {plan.strategy}, "
        f"{len(plan.segments)} segment(s){peaks}",
        fontsize=9,
    )
    ax.set_xlabel("step events: forward ops, then backward ops (recompute shaded)")
    ax.set_ylabel(f"live activation memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")


def _fmt(n: float) -> str:
    from fxckpt.plan import format_bytes

    return format_bytes(n)


def _curve(ax: Any, timeline: Sequence[tuple[str, int]], scale: float, label: str, color: str,
           style: str, width: float) -> None:
    ys = [b / scale for _, b in timeline]
    ax.step(
        range(len(ys)),
        ys,
        where="post",
        color=color,
        linestyle=style,
        linewidth=width,
        label=label,
    )


def _phases(ax: Any, timeline: Sequence[tuple[str, int]], n_forward: int) -> None:
    ax.axvspan(0, n_forward, color="C0", alpha=0.05, linewidth=0)
    ax.axvline(n_forward, color="#555555", linewidth=0.6)
    ax.text(
        n_forward, 0.01, " backward →", transform=ax.get_xaxis_transform(), fontsize=7, va="bottom"
    )
    start = None
    spans = 0
    for i, (event, _) in enumerate([*timeline, ("end", 0)]):
        if event.startswith("recompute") and start is None:
            start = i
        elif not event.startswith("recompute") and start is not None:
            ax.axvspan(
                start,
                i,
                color="C1",
                alpha=0.25,
                linewidth=0,
                label="recompute" if not spans else None,
                gid="recompute",
            )
            spans += 1
            start = None


def _measured(ax: Any, measured: Any, n_forward: int, steps: int, scale: float) -> None:
    def stretch(values: Sequence[int], lo: float, hi: float) -> list[float]:
        count = max(len(values) - 1, 1)
        return [lo + (hi - lo) * i / count for i in range(len(values))]

    xs = stretch(measured.forward, 0, n_forward) + stretch(measured.backward, n_forward, steps - 1)
    ys = [b / scale for b in (*measured.forward, *measured.backward)]
    ax.plot(
        xs,
        ys,
        color="C3",
        linewidth=0.8,
        alpha=0.9,
        label=f"measured (live tensors, peak {_fmt(measured.peak_bytes)}; stretched per phase)",
    )


def _mark_peak(ax: Any, timeline: Sequence[tuple[str, int]], scale: float) -> None:
    if not timeline:
        return
    i = max(range(len(timeline)), key=lambda k: timeline[k][1])
    event, value = timeline[i]
    ax.annotate(
        f"peak: {event}",
        (i, value / scale),
        xytext=(10, 8),
        textcoords="offset points",
        fontsize=7,
        arrowprops={"arrowstyle": "->", "linewidth": 0.6},
    )

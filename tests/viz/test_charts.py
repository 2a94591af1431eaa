"""viz/charts.py: ``fxckpt.plot_pareto`` (the trade-off curve and marked plans) and
``plot_schedule`` (a bar per pass of each micro-batch and stage)."""

from __future__ import annotations


import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import fxckpt  # noqa: E402
from fxckpt.viz import plot_schedule  # noqa: E402
from models import MLP  # noqa: E402
from .viz_support import X  # noqa: E402


def test_plot_pareto_draws_the_curve_and_marked_plans(plain) -> None:
    fig = fxckpt.plot_pareto(MLP(), example_inputs=(X,), points=5, mark={"every=2": plain})
    ax = fig.axes[0]
    curve = next(line for line in ax.get_lines() if line.get_gid() == "pareto")
    peaks, recompute = list(curve.get_xdata()), list(curve.get_ydata())
    assert 2 <= len(peaks) <= 5
    order = sorted(range(len(peaks)), key=peaks.__getitem__)
    assert all(
        recompute[a] >= recompute[b] for a, b in zip(order, order[1:])
    )  # more memory, less recompute
    assert "every=2" in [t.get_text() for t in ax.get_legend().get_texts()]
    plan = fxckpt.inspect(plain).plan
    mark = next(c for c in ax.collections if c.get_gid() == "mark:every=2")
    scale = 2 ** 10 if "(KiB)" in ax.get_xlabel() else 1  # same units as the curve
    x, y = mark.get_offsets()[0]
    assert x == pytest.approx(plan.predicted_peak / scale)  # reserve included, as the curve
    assert y == pytest.approx(100 * plan.recompute_share)
    assert f"recompute ~{y:.0f}% of a forward pass" in plan.summary()  # one unit everywhere
    assert max(peaks) == pytest.approx(plan.eager_peak / scale)
    assert plan.verified_peak is not None  # every plan is verified, and marked there too
    hollow = next(c for c in ax.collections if c.get_gid() == "verified:every=2")
    assert hollow.get_offsets()[0][0] == pytest.approx(plan.verified_peak / scale)


@pytest.mark.parametrize("mode, hatched", [("except_last", 2), ("always", 4), ("never", 0)])
def test_plot_schedule_has_a_bar_per_pass_of_each_micro_batch_and_stage(
    mode: str, hatched: int
) -> None:
    tm = fxckpt.transform(
        MLP(), every=2, chunks=2, devices=["cpu", "cpu"], checkpoint=mode, example_inputs=(X,)
    )
    fig = plot_schedule(tm)
    bars = [
        p for p in fig.axes[0].patches if (p.get_gid() or "").startswith(("forward", "backward"))
    ]
    assert len(bars) == 2 * 2 * 2  # forward and backward x 2 micro-batches x 2 stages
    assert sum(1 for b in bars if b.get_hatch()) == hatched


def test_schedule_needs_stages(plain) -> None:
    with pytest.raises(ValueError, match="no pipeline stages"):
        plot_schedule(plain)


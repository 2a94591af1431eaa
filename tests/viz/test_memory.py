"""viz/memory.py: ``fxckpt.plot_memory`` draws the simulated curves of the plan and of no
checkpointing, the measured one, each segment's recompute span and the plan's own peaks."""

from __future__ import annotations


import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import fxckpt  # noqa: E402
from .viz_support import X  # noqa: E402


def test_plot_memory_predicts_and_measures(plain) -> None:
    from fxckpt.runtime.state import alone

    grads_before = [p.grad for p in plain.parameters()]
    rng = torch.get_rng_state()
    was_alone = alone()  # with another thread alive the measured step's draws are left as drawn
    fig = fxckpt.plot_memory(plain, inputs=(X,))
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "simulated, this plan" in labels and "simulated, no checkpointing" in labels
    measured = next(line for line in ax.get_lines() if line.get_label().startswith("measured"))
    predicted = next(line for line in ax.get_lines() if line.get_label() == "simulated, this plan")
    ratio = max(measured.get_ydata()) / max(predicted.get_ydata())
    assert 0.8 <= ratio <= 1.3, (
        ratio
    )  # the tracker agrees with the simulator within a few ops' worth
    spans = [p for p in ax.patches if p.get_gid() == "recompute"]
    assert len(spans) == len(
        fxckpt.inspect(plain).plan.segments
    )  # each segment is recomputed once, in its own span
    assert [p.grad for p in plain.parameters()] == grads_before
    assert torch.equal(torch.get_rng_state(), rng) or not was_alone


def test_plot_memory_of_a_staged_plan_is_per_micro_batch(staged) -> None:
    fig = fxckpt.plot_memory(staged)
    assert "one micro-batch" in fig.axes[0].get_title()
    assert len([p for p in fig.axes[0].patches if p.get_gid() == "recompute"]) == len(
        fxckpt.inspect(staged).plan.segments
    )


def test_plot_memory_titles_the_plans_own_peaks(plain) -> None:
    from fxckpt.plan import format_bytes

    plan = fxckpt.inspect(plain).plan
    ax = fxckpt.plot_memory(plain).axes[0]
    assert plan.verified_peak is not None  # every plan is verified: its peak is the title's
    assert (f"verified peak {format_bytes(plan.peak_bytes)} vs "
            f"{format_bytes(plan.eager_peak_bytes)} eager") in ax.get_title()
    line = next(line for line in ax.get_lines() if line.get_gid() == "predicted_peak")
    scale = 2 ** 10 if "(KiB)" in ax.get_ylabel() else 1
    assert line.get_ydata()[0] == pytest.approx(plan.predicted_peak / scale)
"""Pictures: each returns a figure with the elements the plan implies, for plain and staged
plans."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import fxckpt  # noqa: E402
from fxckpt.viz import plot_schedule  # noqa: E402
from fxckpt.viz.layout import parse_plain  # noqa: E402
from models import MLP  # noqa: E402

X = torch.randn(8, 32)


@pytest.fixture(scope="module")
def plain() -> fxckpt.TransformedModule:
    return fxckpt.transform(MLP(), every=2, example_inputs=(X,))


@pytest.fixture(scope="module")
def staged() -> fxckpt.TransformedModule:
    return fxckpt.transform(MLP(), every=2, chunks=2, devices=["cpu", "cpu"], example_inputs=(X,))


def _segment_artists(fig) -> list[str]:
    return sorted(
        c.get_label() for c in fig.axes[0].collections if c.get_label().startswith("segment_")
    )


def _legend(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_show_colours_every_segment(plain, tmp_path: Path) -> None:
    fig = fxckpt.show(plain, tmp_path / "g.png")
    assert (
        _segment_artists(fig) == sorted(s.name for s in fxckpt.inspect(plain).plan.segments)
        and len(fxckpt.inspect(plain).plan.segments) == 3
    )
    kept = next(c for c in fig.axes[0].collections if c.get_label().startswith("kept"))
    assert len(kept.get_offsets()) == 2  # the input x and the head: kept, not recomputed
    members = {c.get_label(): len(c.get_offsets()) for c in fig.axes[0].collections}
    assert [members[s.name] for s in fxckpt.inspect(plain).plan.segments] == [
        len(s.nodes) for s in fxckpt.inspect(plain).plan.segments
    ]
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_show_outlines_stages(staged) -> None:
    fig = fxckpt.show(staged)
    assert _segment_artists(fig) == sorted(s.name for s in fxckpt.inspect(staged).plan.segments)
    assert [t for t in _legend(fig) if t.startswith("stage")] == ["stage 0 (cpu)", "stage 1 (cpu)"]
    borders = {
        tuple(c)
        for coll in fig.axes[0].collections
        if coll.get_label().startswith("segment")
        for c in coll.get_edgecolors()
    }
    assert len(borders) == 2  # recomputed ops sit in two stages, one border colour each


def test_big_graphs_collapse_to_modules_and_keep_every_segment() -> None:
    tm = fxckpt.transform(MLP(depth=24), every=3, example_inputs=(X,))
    fig = fxckpt.show(tm, max_nodes=12)
    boxes = sum(
        len(c.get_offsets())
        for c in fig.axes[0].collections
        if c.get_label() and c.get_label()[0] != "_"
    )
    assert boxes <= 12 + 1  # + the graph input
    assert "collapsed to modules" in fig.axes[0].get_title("left")
    assert (
        _segment_artists(fig) == sorted(s.name for s in fxckpt.inspect(tm).plan.segments)
        and len(fxckpt.inspect(tm).plan.segments) == 8
    )


def test_show_uses_graphviz_dot_when_installed(
    plain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "dot"  # speaks just enough of `dot -Tplain`
    fake.write_text(
        f"#!{sys.executable}\nimport re, sys\n"
        "ids = re.findall(r'^(n\\d+);$', sys.stdin.read(), re.M)\n"
        "print('graph 1 10 10')\nfor i, n in enumerate(ids):\n"
        "    print('node', n, i % 3, -i, 1, 1)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fig = fxckpt.show(plain)
    assert "dot layout" in fig.axes[0].get_title("left")
    assert parse_plain("graph 1 2 2\nnode n0 1.5 2.0 1 1 x\nedge n0 n1", {"n0": "x"}) == {
        "x": (1.5, 2.0)
    }


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


def test_pictures_of_a_loaded_module(plain, tmp_path: Path) -> None:
    fxckpt.save(plain, tmp_path / "m")
    loaded = fxckpt.load(tmp_path / "m")
    assert _segment_artists(fxckpt.show(loaded)) == _segment_artists(fxckpt.show(plain))
    assert (
        len([p for p in fxckpt.plot_memory(loaded).axes[0].patches if p.get_gid() == "recompute"])
        == 3
    )


def test_missing_matplotlib_says_how_to_install_it(plain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'fxckpt\[viz\]'"):
        fxckpt.show(plain)


def _labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_show_labels_nodes_with_module_paths_as_the_tables_do(plain) -> None:
    labels = _labels(fxckpt.show(plain))
    assert {"layers.0.fc", "layers.0: gelu", "layers.0.drop", "head", "x"} <= set(labels)
    assert not [t for t in labels if "layers_" in t]
    modules = {m for s in fxckpt.inspect(plain).plan.segments for m in s.module_paths}
    assert all(any(t.startswith(m) for t in labels) for m in modules)


class _Plumbed(torch.nn.Module):
    """A model with shape plumbing: chunk (getitem), view and size between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(torch.relu(a * b).view(x.size(0), -1))


def test_show_hides_shape_plumbing_unless_asked() -> None:
    tm = fxckpt.transform(_Plumbed(), every=1, example_inputs=(X,))
    hidden, shown = _labels(fxckpt.show(tm)), _labels(fxckpt.show(tm, plumbing=True))
    plumbing = {"chunk", "getitem", "getitem_1", "view", "size"}
    assert plumbing <= set(shown) and not plumbing & set(hidden)
    assert {"fc1", "mul", "relu", "fc2"} <= set(hidden)
    title = fxckpt.show(tm).axes[0].get_title("left")
    assert f"{len(shown) - len(hidden)} plumbing op(s) hidden" in title


def test_segment_fills_and_stage_borders_come_from_different_colour_families(staged) -> None:
    import colorsys

    from fxckpt.viz.common import COOL, WARM

    fig = fxckpt.show(staged)
    fills, borders = set(), set()
    for coll in fig.axes[0].collections:
        if coll.get_label().startswith("segment"):
            fills |= {tuple(c[:3]) for c in coll.get_facecolors()}
            borders |= {tuple(c[:3]) for c in coll.get_edgecolors()}

    def hue(rgb: tuple) -> float:  # degrees, rounded: the arcs' ends are in them
        return round(360 * colorsys.rgb_to_hsv(*rgb)[0], 6) % 360

    assert len(fills) == 3 and len(borders) == 2
    assert all(hue(c) >= WARM[0] % 360 or hue(c) <= WARM[1] for c in fills)
    assert all(COOL[0] <= hue(c) <= COOL[1] for c in borders)


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

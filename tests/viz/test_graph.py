"""viz/graph.py: ``fxckpt.show`` draws every op of the plan, coloured by segment and outlined
by stage, collapsed to modules past ``max_nodes``, laid out by graphviz when installed."""

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
from fxckpt.viz.layout import parse_plain  # noqa: E402
from models import MLP  # noqa: E402
from .viz_support import X, _labels, _legend, _segment_artists  # noqa: E402


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


"""fxckpt.viz: the pictures of a loaded module, as of the module it was saved from. Each picture's
own tests are beside its module (test_graph.py, test_memory.py, test_charts.py, test_common.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import fxckpt  # noqa: E402
from .viz_support import _segment_artists  # noqa: E402


def test_pictures_of_a_loaded_module(plain, tmp_path: Path) -> None:
    fxckpt.save(plain, tmp_path / "m")
    loaded = fxckpt.load(tmp_path / "m")
    assert _segment_artists(fxckpt.show(loaded)) == _segment_artists(fxckpt.show(plain))
    assert (
        len([p for p in fxckpt.plot_memory(loaded).axes[0].patches if p.get_gid() == "recompute"])
        == 3
    )


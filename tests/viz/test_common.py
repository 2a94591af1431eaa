"""viz/common.py: what every picture shares: matplotlib required with how to install it, and
segment fills and stage borders from different colour families."""

from __future__ import annotations

import sys

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import fxckpt  # noqa: E402


def test_missing_matplotlib_says_how_to_install_it(plain, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'fxckpt\[viz\]'"):
        fxckpt.show(plain)


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


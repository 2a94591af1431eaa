"""What the picture tests share: the input they draw the MLP at, and what they read off a
figure (its segments' artists, legend and node labels)."""

from __future__ import annotations

import torch

X = torch.randn(8, 32)

def _segment_artists(fig) -> list[str]:
    return sorted(
        c.get_label() for c in fig.axes[0].collections if c.get_label().startswith("segment_")
    )


def _legend(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def _labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


"""Sizes of calls under a budget: buckets, grown dimensions, and the line through peaks.

The plan cache (:mod:`fxckpt.serve.plan_cache`) checks a growing call at its grown dimensions
rounded up to the next power of two (:func:`bucket`), and skips or moves checks by
:class:`Growth`'s prediction. The same rules serve a whole graph's calls and a graph Dynamo made
dynamic (whose inputs are a flat list: :func:`sizes_of`, :func:`is_dynamic`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Generic, Optional, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxckpt.signature import Shapes

__all__ = ["Growth", "JUMP", "JUMP_SHARE", "bucket", "grown_dims", "is_dynamic", "padded_args",
           "scaled", "sizes_of", "volume"]

K = TypeVar("K")

JUMP = 3
"""Doublings past the bucket at which the latest plan may be checked first, when predicted to
hold there (:class:`Growth`)."""
JUMP_SHARE = 0.9
"""A check further on is tried only where the predicted peak is at most this share of the
budget (a miss costs one check more)."""


class Growth(Generic[K]):
    """Verified peaks noted with the total size (elements over every input) of the call they
    were measured at; from them, the bytes that do not grow with the inputs and a plan's peak at
    a larger size (a straight line through its latest peak and those fixed bytes)."""

    REMEMBERED = 16
    """Peaks remembered (the latest)."""

    def __init__(self) -> None:
        self.points: list[tuple[K, int, int]] = []

    def saw(self, compiled: K, volume: int, peak: Optional[int]) -> None:
        if peak is not None:
            self.points.append((compiled, volume, peak))
            del self.points[:-self.REMEMBERED]

    def fixed(self) -> Optional[float]:
        """The bytes at size 0 of the line through the latest two peaks one plan had at two
        sizes (weights, gradients: what a larger call does not add to), or ``None``."""
        for i in range(len(self.points) - 1, 0, -1):
            plan, v2, p2 = self.points[i]
            for other, v1, p1 in reversed(self.points[:i]):
                if other is plan and v1 != v2:
                    slope = (p2 - p1) / (v2 - v1)
                    return min(max(0.0, p1 - slope * v1), float(min(p1, p2)))
        return None

    def predict(self, compiled: K, volume: int) -> Optional[float]:
        """``compiled``'s peak at a call of ``volume`` elements, extrapolated; ``None`` before
        there is anything to extrapolate from."""
        own = [(v, p) for plan, v, p in self.points if plan is compiled and v > 0]
        fixed = self.fixed()
        if not own or fixed is None:
            return None
        size, peak = own[-1]
        return fixed + (peak - fixed) * volume / size


def grown_dims(seen: list[Shapes], key: Shapes) -> set[tuple[int, int]]:
    """``(tensor, dim)`` positions where ``key`` is larger than the largest of ``seen`` of its
    structure."""
    alike = [s for s in seen if len(s) == len(key) and all(len(a) == len(b)
                                                         for a, b in zip(s, key))]
    if not alike:
        return set()
    largest = max(alike, key=volume)
    return {(i, d) for i, (new, old) in enumerate(zip(key, largest))
            for d, (n, o) in enumerate(zip(new, old)) if n > o}


def bucket(size: int) -> int:
    """The size a growing dimension is planned at: the next power of two."""
    return 1 << max(0, size - 1).bit_length()


def scaled(key: Shapes, grown: set[tuple[int, int]], scale: int = 1) -> Shapes:
    """``key`` with the grown dimensions bucketed, times ``scale``."""
    return tuple(tuple(bucket(n) * scale if (i, d) in grown else n for d, n in enumerate(shape))
                 for i, shape in enumerate(key))


def padded_args(args: tuple, kwargs: dict, key: Shapes, grown: set[tuple[int, int]],
                scale: int = 1, fake: bool = False) -> Optional[tuple[tuple, dict]]:
    """Placeholder arguments with the grown dimensions bucketed (times ``scale``), or ``None``
    when nothing grew. Zeros (planning reads shapes only), or with ``fake`` fake tensors, which
    take no memory: a placeholder made in the middle of a step must not add to its peak."""
    if not grown:
        return None
    index = 0
    mode = FakeTensorMode() if fake else None

    def pad(t: torch.Tensor) -> torch.Tensor:
        nonlocal index
        i, index = index, index + 1
        shape = [bucket(n) * scale if (i, d) in grown else n for d, n in enumerate(t.shape)]
        if list(t.shape) == shape:
            return t
        with mode or contextlib.nullcontext():
            placeholder = torch.zeros(shape, dtype=t.dtype, device=t.device)
        return placeholder.requires_grad_(t.requires_grad)

    padded = pytree.tree_map_only(torch.Tensor, pad, (args, kwargs))
    return padded if index == len(key) else None


def volume(shapes: Shapes) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def sizes_of(args: tuple) -> Shapes:
    """The shapes of a Dynamo graph's tensor inputs (its integer inputs are not sizes: a counter
    the module keeps is one)."""
    return tuple(tuple(int(d) for d in a.shape) for a in args if isinstance(a, torch.Tensor))


def is_dynamic(inputs: list[Any]) -> bool:
    """Whether Dynamo handed over a graph with symbolic sizes (they arrive as SymInt inputs)."""
    return any(isinstance(i, torch.SymInt) for i in inputs)

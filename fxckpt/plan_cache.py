"""Which plan serves a call's shapes, under a memory budget: reuse, buckets, a bounded cache.

A plan depends on sizes only under a budget (it is fitted to the peak at one shape); otherwise one
plan serves every shape of a capture. Under a budget:

* **Reuse.** A plan made for shapes at least as large in every dimension serves a smaller call:
  its peak there is lower still.
* **Buckets.** When a call is larger than every plan so far, the dimensions that grew are rounded
  up to the next power of two. If the latest plan, verified on fake tensors at those sizes, still
  holds its budget (in bytes, as solved), it serves them: one verification, no planning. Else a
  plan is made for those sizes (on placeholder inputs). A batch that grows by one each step is
  verified at most ``log2`` times and planned only when the budget binds. Where the
  bucketed sizes cannot be planned (the model allows no such size, a ``loss_fn`` closes over
  tensors of the call's size) the call's own sizes are planned, and buckets are not tried again
  for that capture.
* **Bounded.** A capture keeps at most :data:`MAX_PLANS` plans; the least recently used goes.
* **Never a failure mid-training.** When a smaller call's own plan cannot meet the budget (a
  fraction of a small step is mostly what does not shrink with the batch) but a larger call was
  planned under it, the smaller call gets the plan with the smallest peak, and a warning says so.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from fxckpt.budget import Budget, BudgetInfeasibleError
from fxckpt.signature import Shapes, dominates

__all__ = ["PlanCache", "MAX_PLANS", "bucket"]

log = logging.getLogger(__name__)

MAX_PLANS = 8
"""Plans kept per capture under a budget (least recently used dropped first): enough for the
power-of-two buckets of a batch from 1 to 128, or of a few sequence lengths."""

Build = Callable[[tuple, dict, Optional[Budget]], Any]
"""Plan for these call arguments (with this budget instead of the configured one, if given)."""
ShapesOf = Callable[[tuple, dict], Shapes]
"""The shapes a call's arguments are planned at (the first micro-batch's)."""
Fits = Callable[[Any, tuple, dict], bool]
"""Whether a plan's verified peak for calls like these is within its budget."""


class PlanCache:
    """The plans made on one capture, keyed by shapes (``None``: one plan for every shape)."""

    def __init__(self) -> None:
        self.plans: collections.OrderedDict[Optional[Shapes], Any] = collections.OrderedDict()
        self.buckets = True
        """Whether bucketed sizes may still be tried on this capture."""
        self.beyond: set[Shapes] = set()
        """Bucketed sizes the budget cannot be met at (the call's own sizes are planned)."""

    def values(self) -> list[Any]:
        return list(self.plans.values())

    def find(self, key: Optional[Shapes]) -> Optional[Any]:
        """The plan for exactly these shapes, or the smallest made for larger ones."""
        if key in self.plans:
            self.plans.move_to_end(key)
            return self.plans[key]
        if key is None:
            return None
        larger = [s for s in self.plans if s is not None and dominates(s, key)]
        if not larger:
            return None
        best = min(larger, key=_volume)
        log.debug("reusing the plan made for %s for %s", best, key)
        self.plans.move_to_end(best)
        return self.plans[best]

    def make(self, key: Optional[Shapes], args: tuple, kwargs: dict, build: Build,
             shapes_of: ShapesOf, accepts: Callable[[Shapes], bool],
             planned_larger: bool, fits: Optional[Fits] = None) -> tuple[Any, bool]:
        """The plan for a call with shapes ``key``, kept; and whether it was made now.

        A larger call first tries the latest plan: when ``fits`` says its verified peak at the
        bucketed sizes is within its budget, that plan serves them too, and nothing is planned.
        Else a plan is made for the bucketed sizes, or for the call's own.
        ``planned_larger``: a call at least as large was planned under the budget before (in
        any capture of such calls), so a budget this call cannot meet falls back to the plan
        with the smallest peak instead of failing training.
        """
        if key is not None and self.buckets and self.plans:
            padded = _padded(args, kwargs, key, self._grown(key))
            if padded is not None:
                bucketed = shapes_of(*padded)
                latest = next(reversed(self.plans.values()))
                # beyond the budget at the bucket: whether it holds at the call's own sizes
                sizes, (a, k) = ((key, (args, kwargs)) if bucketed in self.beyond
                                 else (bucketed, padded))
                if accepts(sizes) and fits is not None and fits(latest, a, k):
                    log.debug("the latest plan holds its budget at %s too", sizes)
                    return self._keep(sizes, latest), False
                if bucketed != key and bucketed not in self.beyond and accepts(bucketed):
                    try:
                        compiled = build(*padded, None)
                        if _unverified(compiled):
                            raise RuntimeError("the plan could not be verified at those sizes")
                        return self._keep(bucketed, compiled), True
                    except BudgetInfeasibleError:  # the budget binds before the bucket's sizes
                        self.beyond.add(bucketed)
                    except Exception as e:  # sizes the model or its loss_fn cannot take
                        self.buckets = False
                        log.info("fxckpt: planning for bucketed sizes %s failed (%s: %s); "
                                 "planning each size as it comes", bucketed, type(e).__name__, e)
        try:
            compiled = build(args, kwargs, None)
        except BudgetInfeasibleError as e:
            if not planned_larger:
                raise
            log.warning(
                "fxckpt: the budget cannot be met at the shapes %s (the smallest peak is %d "
                "bytes), but a larger call was planned under it; this call uses the plan with "
                "the smallest peak. A budget in bytes holds for every batch size", key,
                e.min_budget)
            compiled = build(args, kwargs, Budget(bytes=e.min_budget))
        return self._keep(key, compiled), True

    def _grown(self, key: Shapes) -> set[tuple[int, int]]:
        """``(tensor, dim)`` positions where ``key`` is larger than the largest plan so far."""
        planned = [s for s in self.plans if s is not None and len(s) == len(key)
                   and all(len(a) == len(b) for a, b in zip(s, key))]
        if not planned:
            return set()
        largest = max(planned, key=_volume)
        return {(i, d) for i, (new, old) in enumerate(zip(key, largest))
                for d, (n, o) in enumerate(zip(new, old)) if n > o}

    def _keep(self, key: Optional[Shapes], compiled: Any) -> Any:
        self.plans[key] = compiled
        self.plans.move_to_end(key)
        while len(self.plans) > MAX_PLANS:
            dropped, _ = self.plans.popitem(last=False)
            log.debug("dropped the least recently used plan (for %s)", dropped)
        return compiled


def _unverified(compiled: Any) -> bool:
    """A budget plan left with simulated figures only (its step failed on fake tensors)."""
    plan = getattr(compiled, "plan", None)
    return plan is not None and plan.budget is not None and plan.verified_peak is None


def bucket(size: int) -> int:
    """The size a growing dimension is planned at: the next power of two."""
    return 1 << max(0, size - 1).bit_length()


def _padded(args: tuple, kwargs: dict, key: Shapes,
            grown: set[tuple[int, int]]) -> Optional[tuple[tuple, dict]]:
    """Placeholder arguments with the grown dimensions bucketed (zeros: planning reads shapes
    only), or ``None`` when nothing grew."""
    if not grown:
        return None
    index = 0

    def pad(t: torch.Tensor) -> torch.Tensor:
        nonlocal index
        i, index = index, index + 1
        shape = [bucket(n) if (i, d) in grown else n for d, n in enumerate(t.shape)]
        if list(t.shape) == shape:
            return t
        return torch.zeros(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)

    padded = pytree.tree_map_only(torch.Tensor, pad, (args, kwargs))
    return padded if index == len(key) else None


def _volume(shapes: Shapes) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total

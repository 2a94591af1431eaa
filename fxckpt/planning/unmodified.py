"""Calls that need no plan: the unmodified step fits a budget in bytes, so the model runs as is.

A budget in bytes is often far above what a small call holds: the first batches of a growing
batch, a short sequence, a model smaller than the budget it was given. Capturing and planning
such a call costs seconds and buys nothing. :class:`Unmodified` measures the unmodified step on
fake tensors instead (as verification does) and, while it fits, the transformed module calls the
model's own forward: no capture, no plan, no recompute, the same gradients by construction.
"""

from __future__ import annotations

from typing import Callable, Optional

from fxckpt.planning.sizes import (
    JUMP_SHARE, Growth, ShapesOf, grown_dims, padded_args, scaled, volume,
)
from fxckpt.signature import Shapes, dominates

__all__ = ["Unmodified"]

LEAP = 5
"""Doublings past the bucket at which a growing call may first be measured, where the peaks
seen predict the unmodified step holds well under the budget there (a measurement costs about
what one verification of a plan does; :data:`fxckpt.planning.sizes.JUMP` is the plans' own)."""

class Unmodified:
    """Calls of one structure whose unmodified step holds a budget in bytes: they run the model
    as it is, with no capture and no plan, until a call would not fit (see the module docstring).

    ``runs`` answers for each call. A call no larger than sizes that held runs at once. A larger
    one is measured at its grown dimensions bucketed, or first up to :data:`LEAP` buckets
    further on where the peaks seen predict it holds under
    :data:`~fxckpt.planning.sizes.JUMP_SHARE` of the budget. A growing batch is so measured a
    few times, not every step. The first call that does not fit (or cannot be measured) closes
    the way for good: from then on these calls are planned, and the plan cache starts from here
    (:meth:`fxckpt.planning.plan_cache.PlanCache.start_from`), its first plan fitted against the
    unmodified peak measured at the sizes it is made for.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held: list[Shapes] = []
        """Sizes whose unmodified step verified within the budget."""
        self.measured: dict[Shapes, int] = {}
        """The unmodified step's verified peak, by the sizes it was measured at."""
        self.closed = False
        self.buckets = True
        """Whether grown sizes may still be measured (not after a step that could not run at
        them: a ``loss_fn`` closing over targets of the call's size)."""
        self.peak: Optional[int] = None
        """The verified peak at the sizes that served the latest call that ran unmodified."""

    def runs(self, key: Shapes, args: tuple, kwargs: dict,
             peak_at: Callable[[tuple, dict], Optional[int]], shapes_of: ShapesOf) -> bool:
        """Whether the call with shapes ``key`` runs the model unmodified (measuring its step on
        fake tensors with ``peak_at`` when no size that held covers it)."""
        if self.closed:
            return False
        covering = [s for s in self.held if dominates(s, key)]
        if covering:
            self.peak = self.measured[min(covering, key=volume)]
            return True
        grown = grown_dims(self.held, key) if self.buckets else set()
        tries: list[tuple[tuple, dict]] = []
        for doublings in range(LEAP, 0, -1) if grown else ():
            far = scaled(key, grown, 1 << doublings)
            predicted = self._predict(volume(far), bound=True)
            if predicted is not None and predicted <= JUMP_SHARE * self.budget:
                padded = padded_args(args, kwargs, key, grown, 1 << doublings)
                if padded is not None and shapes_of(*padded) == far:
                    tries.append(padded)
                break
        tries.append(padded_args(args, kwargs, key, grown) or (args, kwargs))
        for a, k in tries:  # (grows when grown sizes fail: the call's own are tried last)
            sizes = shapes_of(a, k)
            if sizes in self.measured or (a is not args and not self.buckets):
                continue
            peak = peak_at(a, k)
            if peak is None and a is not args:  # the step cannot run at grown sizes
                self.buckets = False
                if tries[-1][0] is not args:
                    tries.append((args, kwargs))
                continue
            if peak is None:
                break
            self.measured[sizes] = peak
            if peak <= self.budget:
                self.held.append(sizes)
                self.peak = peak
                return True
        self.closed = True
        return False

    def _predict(self, size: int, bound: bool = False) -> Optional[float]:
        """The unmodified step's peak at ``size`` elements, on the line through those measured;
        ``bound``: with one measurement, the line through it and zero, which no larger call's
        peak exceeds (what does not grow with the call is never negative)."""
        growth: Growth[Unmodified] = Growth()
        for sizes, peak in self.measured.items():
            growth.saw(self, volume(sizes), peak)
        predicted = growth.predict(self, size)
        if predicted is None and bound and len(self.measured) == 1:
            (sizes, peak), = self.measured.items()
            predicted = peak * size / max(1, volume(sizes))
        return predicted

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
* **Peaks seen, extrapolated** (:class:`Growth`). Every verified peak is noted with the size
  of the call it was measured at. A step's bytes are nearly affine in a growing batch (weights
  and their gradients fixed, activations proportional), so two peaks of one plan give the part
  that does not grow, and a plan's peak at a larger size is predicted from its latest one. A
  check the prediction says fails is not run: the call is planned at once. When the latest plan
  is predicted to hold well under its budget a few buckets further on, it is checked there
  first, and one check serves every size up to it. A prediction only skips or moves checks;
  every plan that serves a call was verified at sizes at least as large.
* **A failed check is not wasted.** The latest plan with no segments runs the unmodified step,
  so its peak at the bucket is the eager one the next plan is fitted against: the build is
  given it instead of measuring it again.
* **Bounded.** A capture keeps at most :data:`MAX_PLANS` plans; the least recently used goes.
* **The unmodified step first.** A plan's first candidate is the unmodified step: where its
  peak, verified on the captured graph, fits the budget, the plan has no segment (measured on
  the graph, never by running the model's forward on fake tensors).
* **Never a failure mid-training.** When a smaller call's own plan cannot meet the budget (a
  fraction of a small step is mostly what does not shrink with the batch) but a larger call was
  planned under it, the smaller call gets the plan with the smallest peak, and a warning says so.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Generic, Iterator, Optional, Protocol, TypeVar

from fxckpt.budget import Budget
from fxckpt.errors import BudgetInfeasibleError
from fxckpt.plan import Plan
from fxckpt.serve.sizes import JUMP, JUMP_SHARE, Growth, grown_dims, scaled, volume
from fxckpt.signature import Shapes, dominates

__all__ = ["PlanCache", "Planned", "Planner", "MAX_PLANS", "plan_budget"]

log = logging.getLogger(__name__)

MAX_PLANS = 8
"""Plans kept per capture under a budget (least recently used dropped first): enough for the
power-of-two buckets of a batch from 1 to 128, or of a few sequence lengths."""



class Planned(Protocol):
    """What the cache keeps: anything with a plan (a whole graph's
    :class:`~fxckpt.serve.whole_graph.Compiled`, a Dynamo graph's
    :class:`~fxckpt.serve.dynamo.backend.GraphRecord`)."""

    @property
    def plan(self) -> Plan: ...


P = TypeVar("P", bound=Planned)


class Planner(Protocol[P]):
    """How the plans of one graph are made and checked: the one interface the cache calls,
    implemented for a whole graph (:class:`~fxckpt.serve.entry_planner.EntryPlanner`) and for a
    graph Dynamo made dynamic (:class:`~fxckpt.serve.dynamo.sized.GraphPlanner`)."""

    def shapes(self, args: tuple, kwargs: dict) -> Shapes:
        """The shapes a call's arguments are planned or measured at."""

    def accepts(self, shapes: Shapes) -> bool:
        """Whether the graph serves calls of these shapes (an exported graph's ranges)."""

    def build(self, args: tuple, kwargs: dict, budget: Optional[Budget] = None,
              eager: Optional[int] = None) -> P:
        """Plan for these arguments (with ``budget`` instead of the configured one, if given;
        with the unmodified step's verified peak at these sizes, if already known)."""

    def peak_at(self, planned: P, args: tuple, kwargs: dict) -> Optional[int]:
        """A plan's verified peak for calls like these (``None`` when it cannot be verified)."""

    def padded(self, args: tuple, kwargs: dict, key: Shapes, grown: set[tuple[int, int]],
               scale: int = 1) -> Optional[tuple[tuple, dict]]:
        """Placeholder arguments with the ``grown`` dimensions of ``key`` bucketed (times
        ``scale``), or ``None`` when they cannot be made."""

    def limit(self, planned: P) -> Optional[int]:
        """The bytes ``planned`` must hold at larger sizes to serve them (``None``: it is not a
        verified budget plan, and is never checked there)."""


@contextlib.contextmanager
def _quiet_meta_errors() -> Iterator[None]:
    """torch logs at ERROR every meta kernel that raises on fake tensors; at bucketed sizes a
    model may refuse (a position table shorter than the bucket), which the cache handles by
    planning the call's own sizes, so the log is muted there."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def plan_budget(planned: Planned) -> Optional[int]:
    """:meth:`Planner.limit` of a graph planned alone: the budget in bytes a verified budget
    plan holds (``None``: not such a plan)."""
    plan = planned.plan
    return None if plan.verified_peak is None else plan.budget_bytes


class PlanCache(Generic[P]):
    """The plans made on one capture, keyed by shapes (``None``: one plan for every shape)."""

    def __init__(self) -> None:
        self.plans: collections.OrderedDict[Optional[Shapes], P] = collections.OrderedDict()
        self.buckets = True
        """Whether bucketed sizes may still be tried on this capture."""
        self.beyond: set[Shapes] = set()
        """Bucketed sizes the budget cannot be met at (the call's own sizes are planned)."""
        self.served: Optional[Shapes] = None
        """The key of the plan :meth:`find`, :meth:`make` or :meth:`serve` returned last (the
        sizes it was made or checked at: a call it serves is at most that large)."""
        self.growth: Growth[object] = Growth()
        """The verified peaks seen, by size: what predicts a plan's peak at a larger size."""

    def values(self) -> list[P]:
        return list(self.plans.values())

    def find(self, key: Optional[Shapes]) -> Optional[P]:
        """The plan for exactly these shapes, or the smallest made for larger ones."""
        if key in self.plans:
            self.served = key
            self.plans.move_to_end(key)
            return self.plans[key]
        if key is None:
            return None
        larger = [s for s in self.plans if s is not None and dominates(s, key)]
        if not larger:
            return None
        best = min(larger, key=volume)
        log.debug("reusing the plan made for %s for %s", best, key)
        self.served = best
        self.plans.move_to_end(best)
        return self.plans[best]

    def serve(self, key: Optional[Shapes], args: tuple, kwargs: dict, planner: Planner[P],
              planned_larger: bool = False) -> tuple[P, bool]:
        """The plan for a call with shapes ``key`` (:meth:`find`, else :meth:`make`), and
        whether it was made now."""
        found = self.find(key)
        if found is not None:
            return found, False
        return self.make(key, args, kwargs, planner, planned_larger)

    def make(self, key: Optional[Shapes], args: tuple, kwargs: dict, planner: Planner[P],
             planned_larger: bool = False) -> tuple[P, bool]:
        """The plan for a call with shapes ``key``, kept; and whether it was made now.

        A larger call first tries the latest plan: when its verified peak at the bucketed sizes
        (``planner.peak_at``) is within its budget, that plan serves them too, and nothing is
        planned.
        Else a plan is made for the bucketed sizes, or for the call's own.
        ``planned_larger``: a call at least as large was planned under the budget before (in
        any capture of such calls), so a budget this call cannot meet falls back to the plan
        with the smallest peak instead of failing training.
        """
        if key is not None and self.buckets and self.plans:
            with _quiet_meta_errors():  # a size the model refuses: planned at the call's own
                bucketed = self._bucketed(key, args, kwargs, planner)
            if bucketed is not None:
                return bucketed
        try:
            compiled = planner.build(args, kwargs)
        except BudgetInfeasibleError as e:
            if not planned_larger:
                raise
            log.warning(
                "fxckpt: the budget cannot be met at the shapes %s (the smallest peak is %d "
                "bytes), but a larger call was planned under it; this call uses the plan with "
                "the smallest peak. A budget in bytes holds for every batch size", key,
                e.min_budget)
            compiled = planner.build(args, kwargs, Budget(bytes=e.min_budget))
        if key is not None:
            self.growth.saw(compiled, volume(key), _verified(compiled))
        return self._store(key, compiled), True

    def _bucketed(self, key: Shapes, args: tuple, kwargs: dict,
                  planner: Planner[P]) -> Optional[tuple[P, bool]]:
        """The plan for a call larger than every plan so far at its bucketed sizes: the latest
        plan where it holds there, else one made for them; ``None`` when neither serves."""
        grown = self._grown(key)
        padded = planner.padded(args, kwargs, key, grown)
        if padded is None:
            return None
        bucketed = planner.shapes(*padded)
        latest = next(reversed(self.plans.values()), None)
        # beyond the budget at the bucket: whether it holds at the call's own sizes
        sizes, (a, k) = ((key, (args, kwargs)) if bucketed in self.beyond
                         else (bucketed, padded))
        eager: Optional[int] = None
        if (latest is not None and planner.accepts(sizes)
                and planner.limit(latest) is not None):
            if sizes == bucketed:
                ahead = self._ahead(latest, key, grown, args, kwargs, planner)
                if ahead is not None:
                    return self._store(planner.shapes(*ahead), latest), False
            held, peak = self._check(latest, sizes, a, k, planner)
            if held:
                log.debug("the latest plan holds its budget at %s too", sizes)
                return self._store(sizes, latest), False
            if peak is not None and sizes == bucketed and not _segments(latest):
                eager = peak  # the unmodified step's peak at the bucket
        if bucketed != key and bucketed not in self.beyond and planner.accepts(bucketed):
            try:
                compiled = planner.build(*padded, None, eager)
                if _unverified(compiled):
                    raise RuntimeError("the plan could not be verified at those sizes")
                self.growth.saw(compiled, volume(bucketed), _verified(compiled))
                return self._store(bucketed, compiled), True
            except BudgetInfeasibleError:  # the budget binds before the bucket's sizes
                self.beyond.add(bucketed)
            except Exception as e:  # sizes the model or its loss_fn cannot take
                self.buckets = False
                log.info("fxckpt: planning for bucketed sizes %s failed (%s: %s); "
                         "planning each size as it comes", bucketed, type(e).__name__, e)
        return None

    def _check(self, compiled: P, sizes: Shapes, args: tuple, kwargs: dict,
               planner: Planner[P]) -> tuple[bool, Optional[int]]:
        """Whether ``compiled`` holds its budget at ``sizes``, and the peak measured there
        (``None`` when not measured: the prediction said it would not hold)."""
        budget = planner.limit(compiled)
        assert budget is not None
        predicted = self.growth.predict(compiled, volume(sizes))
        if predicted is not None and predicted > budget:
            log.debug("the latest plan is predicted at %d bytes at %s, over its budget: not "
                      "checked", predicted, sizes)
            return False, None
        peak = planner.peak_at(compiled, args, kwargs)
        if peak is None:
            return False, None
        self.growth.saw(compiled, volume(sizes), peak)
        return peak <= budget, peak

    def _ahead(self, latest: P, key: Shapes, grown: set[tuple[int, int]], args: tuple,
               kwargs: dict, planner: Planner[P]) -> Optional[tuple[tuple, dict]]:
        """Placeholder arguments a few buckets further on at which ``latest`` was checked and
        holds its budget (one check for all the sizes up to them), or ``None``."""
        budget = planner.limit(latest)
        assert budget is not None
        for doublings in range(JUMP, 0, -1):
            far = scaled(key, grown, 1 << doublings)
            predicted = self.growth.predict(latest, volume(far))
            if predicted is None or predicted > JUMP_SHARE * budget or not planner.accepts(far):
                continue
            padded = planner.padded(args, kwargs, key, grown, 1 << doublings)
            if padded is None or planner.shapes(*padded) != far:
                return None
            held, _ = self._check(latest, far, *padded, planner)
            log.debug("the latest plan checked %d bucket(s) ahead, at %s: %s", doublings, far,
                      "holds" if held else "over its budget")
            return padded if held else None
        return None

    def _grown(self, key: Shapes) -> set[tuple[int, int]]:
        """``(tensor, dim)`` positions where ``key`` is larger than the largest plan so far."""
        return grown_dims([s for s in self.plans if s is not None], key)

    def _store(self, key: Optional[Shapes], compiled: P) -> P:
        self.served = key
        self.plans[key] = compiled
        self.plans.move_to_end(key)
        while len(self.plans) > MAX_PLANS:
            dropped, _ = self.plans.popitem(last=False)
            log.debug("dropped the least recently used plan (for %s)", dropped)
        return compiled


def _segments(compiled: Planned) -> bool:
    return bool(compiled.plan.segments)


def _verified(compiled: Planned) -> Optional[int]:
    return compiled.plan.verified_peak


def _unverified(compiled: Planned) -> bool:
    """A budget plan left with simulated figures only (its step failed on fake tensors)."""
    return compiled.plan.budget_bytes is not None and compiled.plan.verified_peak is None

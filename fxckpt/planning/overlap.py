"""``offload="auto"`` where the copies run beside the compute: a GPU's side stream.

The offloader copies what an offloaded segment saves on a side stream of its device
(:mod:`fxckpt.runtime.offload`). On a GPU the copies to the host run while the forward computes
and the copies back while the backward does, so a byte moved costs the step nothing as long as
the host link keeps up with the forward. Under a GPU's prices (a model on CUDA, or a GPU
``device_profile``) an offloaded segment therefore costs only its fixed overhead and its hooks,
for as many bytes as the link moves in the forward's time (:func:`capacity`); past that,
segments recompute.

That price is not a sum over segments (the first bytes are free, the rest cannot go), and the
solver's search adds segment costs. So the plan is searched as a Lagrangian relaxation would:

1. once with no offload: every segment recomputes;
2. then at a price per byte moved at which about the capacity's worth of that plan's segments
   would rather offload than recompute (:func:`price`).

Each plan's segments are then split (:func:`assign`): those whose recompute costs most per byte
offload while their bytes fit in the capacity, the rest recompute. The plan that recomputes
least (:func:`cost`) is taken. Memory is the same whichever way a segment goes: its tensors are
off the device between its forward and its backward either way.

Where copies do not overlap (the CPU's copies are synchronous), each byte moved costs its trip
and the solver prices it so (:attr:`fxckpt.solver.Problem.offload_cost_per_byte`,
:mod:`fxckpt.planning.actions`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Generic, Optional, Sequence, TypeVar

from fxckpt.solver import Problem, Spans

__all__ = ["Overlapped", "capacity", "moved", "assign", "cost", "price", "overlapped",
           "PRICE_STEPS"]

T = TypeVar("T")

PRICE_STEPS = (1.0,)
"""Multiples of :func:`price` the plan is searched at, after the plan without offload. On the
Llama-3-8B and Llama-3.2-1B predictions (``benchmarks.predict``) the multiples 0.5, 0.7, 1.41
and 2 and three bisections between the prices that move more and less than the room found no
cheaper plan than these two (each costs a solve: 1.5 s for the 8B)."""


def capacity(problem: Problem) -> int:
    """Bytes the host link moves out while the forward runs: the forward's cost over the price
    of one byte's trip out (half of :attr:`~fxckpt.solver.Problem.offload_cost_per_byte`, which
    prices the trip out and back). 0 when the problem does not offload."""
    per_byte = problem.offload_cost_per_byte
    if not per_byte:
        return 0
    return int(problem.index.cum_cost[-1] / (per_byte / 2))


def moved(problem: Problem, span: tuple[int, int]) -> int:
    """Bytes an offloaded segment moves: what its ops save, as the offloader's hooks around the
    segment see it (each value once, those made before it included; graph inputs, parameters
    and buffers are not ops and stay). The solver's own price per byte counts the outputs of
    the segment's ops that anything saves (:attr:`fxckpt.solver.problem.Index.cum_saved`),
    which is O(1) a segment; the room is counted as the runtime moves."""
    ix = problem.index
    return sum(ix.out[j] for j in {j for i in range(*span) for j in ix.saves[i]})


def _recompute(problem: Problem, span: tuple[int, int], keep: frozenset[int]) -> float:
    """What running segment ``span`` again costs: the ops up to its early stop, less the gain
    of those it keeps (its overhead and hooks left out: it pays them offloaded too). For a
    problem that does not offload (as this module passes it)."""
    ix = problem.index
    return (ix.cum_cost[ix.recompute_end(*span)] - ix.cum_cost[span[0]]
            - ix.kept_gain([span], keep))


def _by_worth(problem: Problem, ranges: Spans, keep: frozenset[int]
              ) -> list[tuple[int, float, int]]:
    """Segments worth offloading (they recompute something and move something), as
    ``(index, recompute, bytes moved)``, the most recompute per byte moved first."""
    worth = []
    for i, span in enumerate(ranges):
        work, size = _recompute(problem, span, keep), moved(problem, span)
        if work > 0 and size > 0:
            worth.append((i, work, size))
    return sorted(worth, key=lambda item: -item[1] / item[2])


def assign(problem: Problem, ranges: Spans, keep: Sequence[int], room: int) -> list[bool]:
    """Per segment, whether it offloads: the most recompute per byte first, while the bytes
    fit in ``room`` (a segment that does not fit is passed over for smaller ones)."""
    offloads = [False] * len(ranges)
    used = 0
    for i, _, size in _by_worth(problem, ranges, frozenset(keep)):
        if used + size <= room:
            offloads[i] = True
            used += size
    return offloads


def cost(problem: Problem, ranges: Spans, keep: Sequence[int], offloads: Sequence[bool]
         ) -> float:
    """The plan's cost with copies beside the compute: every segment's overhead and hooks, and
    the recompute of those that do not offload (the simulator's units, as
    :attr:`fxckpt.solver.simulate.Simulation.recompute_cost`)."""
    ix, kept = problem.index, frozenset(keep)
    return sum(ix.overhead + ix.hooks(*span) + (0.0 if off else _recompute(problem, span, kept))
               for span, off in zip(ranges, offloads))


def price(problem: Problem, ranges: Spans, keep: Sequence[int], room: int) -> Optional[float]:
    """A price per byte moved at which about ``room`` bytes of these segments would rather
    offload than recompute: the recompute per byte of the first segment past the room, most
    per byte first (half the last one's when all fit). ``None`` when none is worth moving."""
    order = _by_worth(problem, ranges, frozenset(keep))
    if not order:
        return None
    used = 0
    for _, work, size in order:
        used += size
        if used > room:
            return work / size
    _, work, size = order[-1]
    return work / size / 2


@dataclasses.dataclass(frozen=True)
class Overlapped(Generic[T]):
    """The plan taken, with what each of its segments does."""

    laid: T
    """What ``lay`` returned for it."""
    offloads: tuple[bool, ...]
    """Per segment, whether it offloads."""
    cost: float
    """:func:`cost` of the plan."""
    moved: int
    """Bytes its offloaded segments move out in a step."""
    room: int
    """:func:`capacity`."""
    tried: int
    """Plans searched (the first without offload)."""
    price: Optional[float]
    """The price per byte the plan taken was searched at (``None``: without offload)."""


def overlapped(problem: Problem, lay: Callable[[Problem], T],
               extent: Callable[[T], tuple[Spans, Sequence[int]]],
               search: bool = True) -> Overlapped[T]:
    """Search the plan as the module docstring says.

    ``problem`` prices a byte's trip (:func:`capacity` reads it); ``lay(p)`` makes a plan from
    problem ``p`` (its ``offload_cost_per_byte`` is what the solver weighs), ``extent(plan)``
    gives its segments' op ranges and kept op positions. ``search=False`` (segments that do
    not depend on prices: ``every=``, ``depth=``) lays the plan once and only splits it.
    """
    room = capacity(problem)
    plain = dataclasses.replace(problem, offload_cost_per_byte=None)
    first = lay(plain)
    tried: list[tuple[T, Optional[float], tuple[Spans, Sequence[int]]]] = [
        (first, None, extent(first))]
    at = price(plain, *tried[0][2], room) if search and room else None
    if at is not None:
        for step in PRICE_STEPS:
            laid = lay(dataclasses.replace(problem, offload_cost_per_byte=at * step))
            tried.append((laid, at * step, extent(laid)))
    best: Optional[Overlapped[T]] = None
    for laid, at, (ranges, keep) in tried:
        offloads = assign(plain, ranges, keep, room)
        found = Overlapped(laid, tuple(offloads), cost(plain, ranges, keep, offloads),
                           sum(moved(plain, s) for s, o in zip(ranges, offloads) if o),
                           room, len(tried), at)
        if best is None or found.cost < best.cost:
            best = found
    assert best is not None
    return best

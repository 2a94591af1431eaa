"""The memory simulator: one training step of a plan, event by event, in O(n + edges).

This is the cost model every solver is judged by, so it is written to be read, not to be clever.
It walks the schedule PyTorch's non-reentrant checkpoint produces and counts live activation
bytes at every step (graph inputs and parameters count as 0):

    forward:   op 0, op 1, ..., op n-1            (segments run without saving anything)
    backward start                                (outputs alive, output gradients created)
    backward:  op n-1, ..., op 0                  (a segment [s, e) is first recomputed,
                                                   ops s..e-1, just before op e-1's backward)

Every tensor is one interval of steps, added to a difference array, so the whole profile costs
one pass over ops and edges:

* forward value of op ``j``: from its forward step until the latest of its last reader,
  backward start (outputs), and the backward of every *holder*: an op outside segments that saves
  it, or a segment starting after ``j`` that reads it (checkpoint keeps a segment's inputs until
  the segment's backward has finished, i.e. until the backward of its first op).
* recomputed value of op ``j`` in segment ``[s, e)``: from its recompute step until its last
  reader in the segment ran again, or until the backward of the first op in the segment that
  saves it.
* gradient of op ``j``: created by the backward of its last reader (by backward start for
  outputs), freed by op ``j``'s own backward. Later readers' contributions are assumed to
  accumulate in place, and backward temporaries are not modelled. Ops without readers that are not
  outputs get no gradient.

Memory at a step is measured while the step runs: its new allocations are counted, the tensors it
frees are still counted. The peak is the largest such number.
"""

from __future__ import annotations

import dataclasses

from fxckpt.solver.problem import Index, Problem, Segments, check_segments

__all__ = ["Simulation", "simulate", "peak_bytes", "held_at_backward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Simulation:
    """What one training step of a plan costs in the model."""

    peak_bytes: int
    """Largest live activation memory at any step (forward, recompute or backward)."""
    recompute_cost: float
    """Total cost of the ops inside segments (each is run twice)."""
    forward_peak: int
    """Largest live activation memory during the forward pass alone."""
    timeline: tuple[tuple[str, int], ...]
    """``(event, live_bytes)`` per step: ``forward x``, ``backward start``, ``recompute x``,
    ``backward x``."""


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Step numbers of a plan: forward op ``i`` runs at step ``i``; backward start is ``n``."""

    seg_start: list[int]
    """Start of the segment holding each op, -1 outside segments."""
    seg_end: list[int]
    back: list[int]
    """Step of each op's backward."""
    recompute: list[int]
    """Step of each op's recompute, -1 outside segments."""
    steps: int


def _schedule(n: int, segs: Segments) -> _Schedule:
    seg_start, seg_end = [-1] * n, [-1] * n
    for s, e in segs:
        for i in range(s, e):
            seg_start[i], seg_end[i] = s, e
    back, recompute = [0] * n, [-1] * n
    step = n + 1
    for i in range(n - 1, -1, -1):
        s = seg_start[i]
        if s >= 0 and i == seg_end[i] - 1:
            for x in range(s, i + 1):
                recompute[x] = step
                step += 1
        back[i] = step
        step += 1
    return _Schedule(seg_start, seg_end, back, recompute, step)


def _forward_free(ix: Index, sc: _Schedule, j: int) -> int:
    """Last step the forward value of op ``j`` is alive."""
    free = ix.last_alive[j]
    for k in ix.savers[j]:
        if sc.seg_start[k] < 0:
            free = max(free, sc.back[k])
    for k in ix.touchers[j]:
        s = sc.seg_start[k]
        if s > j:
            free = max(free, sc.back[s])
    return free


def _recompute_free(ix: Index, sc: _Schedule, j: int) -> int:
    """Last step the recomputed value of op ``j`` (inside a segment) is alive."""
    end = sc.seg_end[j]
    free = sc.recompute[j]
    for k in ix.touchers[j]:
        if k < end:
            free = max(free, sc.recompute[k])
    for k in ix.savers[j]:
        if k < end:
            free = max(free, sc.back[k])
    return free


def _profile(ix: Index, sc: _Schedule) -> list[int]:
    """Live bytes at every step."""
    n = ix.n
    diff = [0] * (sc.steps + 1)
    for j in range(n):
        o = ix.out[j]
        if o:
            diff[j] += o
            diff[_forward_free(ix, sc, j) + 1] -= o
            if sc.seg_start[j] >= 0:
                diff[sc.recompute[j]] += o
                diff[_recompute_free(ix, sc, j) + 1] -= o
        g = ix.grad[j]
        if g:
            born = n if ix.grad_from[j] == n else sc.back[ix.grad_from[j]]
            diff[born] += g
            diff[sc.back[j] + 1] -= g
    live, total = [], 0
    for step in range(sc.steps):
        total += diff[step]
        live.append(total)
    return live


def peak_bytes(problem: Problem, segments: object = ()) -> int:
    """The peak of :func:`simulate` without building the timeline (for search loops)."""
    ix = problem.index
    live = _profile(ix, _schedule(ix.n, check_segments(segments, ix.n)))
    return max(live, default=0)


def held_at_backward(problem: Problem, segments: object = ()) -> tuple[int, ...]:
    """Bytes of each op's forward value still alive when backward starts (0 when freed earlier).

    What a plan holds from forward to backward, op by op: ``held_at_backward(p)`` minus
    ``held_at_backward(p, segments)`` is what checkpointing those segments lets go of.
    """
    ix = problem.index
    sc = _schedule(ix.n, check_segments(segments, ix.n))
    return tuple(ix.out[j] if _forward_free(ix, sc, j) >= ix.n else 0 for j in range(ix.n))


def _events(problem: Problem, sc: _Schedule) -> list[str]:
    n = len(problem.ops)
    names = [op.name for op in problem.ops]
    events = [f"forward {name}" for name in names] + ["backward start"]
    events += [""] * (sc.steps - n - 1)
    for i in range(n):
        events[sc.back[i]] = f"backward {names[i]}"
        if sc.recompute[i] >= 0:
            events[sc.recompute[i]] = f"recompute {names[i]}"
    return events


def simulate(problem: Problem, segments: object = ()) -> Simulation:
    """Walk forward then backward of ``problem`` under the plan ``segments``.

    ``segments`` are non-overlapping half-open ``(start, end)`` ranges over ``problem.ops``; ops
    inside them are checkpointed (run without saving, recomputed before their backward).
    """
    ix = problem.index
    segs = check_segments(segments, ix.n)
    sc = _schedule(ix.n, segs)
    live = _profile(ix, sc)
    return Simulation(
        peak_bytes=max(live, default=0),
        recompute_cost=sum(ix.segment_cost(s, e) for s, e in segs),
        forward_peak=max(live[: ix.n], default=0),
        timeline=tuple(zip(_events(problem, sc), live)),
    )

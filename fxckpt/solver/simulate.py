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
* kept value of op ``j`` in a segment (selective recompute, ``keep``): computed once in
  forward and held until the step its recompute would have made it, then as a recomputed value;
  the op does not run again, so its cost leaves the recompute cost.
* gradient of op ``j``: created by the backward of its last reader (by backward start for
  outputs), freed by op ``j``'s own backward. Later readers' contributions are assumed to
  accumulate in place, and backward temporaries are not modelled. Ops without readers that are not
  outputs get no gradient.

Memory at a step is measured while the step runs: its new allocations are counted, the tensors it
frees are still counted. The peak is the largest such number plus the problem's reserve
(:attr:`~fxckpt.solver.problem.Problem.reserve_bytes`, for what the walk does not model), so a
peak compares with a budget as it is.
"""

from __future__ import annotations

import dataclasses

from fxckpt.solver.problem import Index, Problem, Spans, check_segments

__all__ = ["Simulation", "simulate", "peak_bytes", "held_at_backward", "check_keep", "profile",
           "kept_span", "kept_live"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Simulation:
    """What one training step of a plan costs in the model."""

    peak_bytes: int
    """Largest live activation memory at any step (forward, recompute or backward), plus the
    problem's reserve: the figure a budget is compared with."""
    recompute_cost: float
    """Total cost of the ops inside segments (each is run twice)."""
    forward_peak: int
    """Largest live activation memory during the forward pass alone (reserve included)."""
    timeline: tuple[tuple[str, int], ...]
    """``(event, live_bytes)`` per step: ``forward x``, ``backward start``, ``recompute x`` (or
    ``reuse x`` for a kept op), ``backward x``; the tensors counted, without the reserve."""
    reserve_bytes: int = 0
    """The problem's reserve, which the peaks include and the timeline does not."""


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


def _schedule(n: int, segs: Spans) -> _Schedule:
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


def check_keep(keep: object, segments: Spans, n: int) -> frozenset[int]:
    """Validate kept op positions: ints inside the plan's segments."""
    try:
        kept: frozenset[int] = frozenset(keep)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"keep must be a collection of op positions (got {keep!r})") from None
    inside = {i for s, e in segments for i in range(s, e)}
    for i in kept:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
            raise ValueError(f"kept op {i!r} must be an op position in 0..{n - 1}")
        if i not in inside:
            raise ValueError(f"kept op {i} is not inside a segment: only recomputed ops are kept")
    return kept


def kept_span(ix: Index, sc: _Schedule, j: int) -> tuple[int, int]:
    """Steps ``[lo, hi)`` a kept op ``j`` adds its bytes to: from the end of its forward life to
    its recompute step (empty when forward already holds it until then)."""
    return _forward_free(ix, sc, j) + 1, sc.recompute[j]


def _kept_free(ix: Index, sc: _Schedule, j: int) -> int:
    """Last step a kept op's value is alive: one life from forward to the recomputed value's end.
    """
    return max(_forward_free(ix, sc, j), _recompute_free(ix, sc, j))


def _profile(ix: Index, sc: _Schedule, keep: frozenset[int] = frozenset()) -> list[int]:
    """Live bytes at every step."""
    n = ix.n
    diff = [0] * (sc.steps + 1)
    for j in range(n):
        o = ix.out[j]
        if o and j in keep:  # one life, forward to the recomputed value's end
            diff[j] += o
            diff[_kept_free(ix, sc, j) + 1] -= o
        elif o:
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


def peak_bytes(problem: Problem, segments: object = (), keep: object = ()) -> int:
    """The peak of :func:`simulate` without building the timeline (for search loops)."""
    ix = problem.index
    segs = check_segments(segments, ix.n)
    live = _profile(ix, _schedule(ix.n, segs), check_keep(keep, segs, ix.n))
    return max(live, default=0) + ix.reserve


def profile(problem: Problem, segments: Spans) -> tuple[list[int], "_Schedule"]:
    """Live bytes per step of ``segments`` (no keeps), reserve included, and the schedule's
    steps, for :mod:`fxckpt.solver.selective`, which adds kept values to it span by span."""
    ix = problem.index
    sc = _schedule(ix.n, check_segments(segments, ix.n))
    return [b + ix.reserve for b in _profile(ix, sc)], sc


def kept_live(problem: Problem, segments: object = (), keep: object = ()) -> list[int]:
    """Bytes of kept outputs alive at each step of :func:`simulate`'s timeline (for pictures)."""
    ix = problem.index
    segs = check_segments(segments, ix.n)
    kept = check_keep(keep, segs, ix.n)
    sc = _schedule(ix.n, segs)
    diff = [0] * (sc.steps + 1)
    for j in kept:
        diff[j] += ix.out[j]
        diff[_kept_free(ix, sc, j) + 1] -= ix.out[j]
    live, total = [], 0
    for step in range(sc.steps):
        total += diff[step]
        live.append(total)
    return live


def held_at_backward(
    problem: Problem, segments: object = (), keep: object = ()
) -> tuple[int, ...]:
    """Bytes of each op's forward value still alive when backward starts (0 when freed earlier).

    What a plan holds from forward to backward, op by op: ``held_at_backward(p)`` minus
    ``held_at_backward(p, segments)`` is what checkpointing those segments lets go of. A kept op
    (``keep``) is held.
    """
    ix = problem.index
    segs = check_segments(segments, ix.n)
    kept = check_keep(keep, segs, ix.n)
    sc = _schedule(ix.n, segs)
    return tuple(ix.out[j] if j in kept or _forward_free(ix, sc, j) >= ix.n else 0
                 for j in range(ix.n))


def _events(problem: Problem, sc: _Schedule, kept: frozenset[int]) -> list[str]:
    n = len(problem.ops)
    names = [op.name for op in problem.ops]
    events = [f"forward {name}" for name in names] + ["backward start"]
    events += [""] * (sc.steps - n - 1)
    for i in range(n):
        events[sc.back[i]] = f"backward {names[i]}"
        if sc.recompute[i] >= 0:
            events[sc.recompute[i]] = f"{'reuse' if i in kept else 'recompute'} {names[i]}"
    return events


def simulate(problem: Problem, segments: object = (), keep: object = ()) -> Simulation:
    """Walk forward then backward of ``problem`` under the plan ``segments``.

    ``segments`` are non-overlapping half-open ``(start, end)`` ranges over ``problem.ops``; ops
    inside them are checkpointed (run without saving, recomputed before their backward), except
    the ops at the positions ``keep``, whose outputs are kept from forward (selective recompute).
    """
    ix = problem.index
    segs = check_segments(segments, ix.n)
    kept = check_keep(keep, segs, ix.n)
    sc = _schedule(ix.n, segs)
    live = _profile(ix, sc, kept)
    return Simulation(
        peak_bytes=max(live, default=0) + ix.reserve,
        recompute_cost=sum(ix.segment_cost(s, e) for s, e in segs)
        - ix.kept_gain(segs, kept),
        forward_peak=max(live[: ix.n], default=0) + ix.reserve,
        timeline=tuple(zip(_events(problem, sc, kept), live)),
        reserve_bytes=ix.reserve,
    )

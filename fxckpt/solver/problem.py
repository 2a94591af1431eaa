"""The solver's input: a training step as plain data, and the facts derived from it once.

The memory-budget solver and its simulator never see ``torch.fx``. A bridge module turns the
annotated graph into a :class:`Problem` — one :class:`Op` per compute node, in topological order,
naming what it reads, what autograd keeps for its backward, and how many bytes it allocates — so
that every solver can be tested on hand-made tables and compared against an exhaustive oracle.

Why these fields and nothing more:

* ``out_bytes`` and ``grad_bytes`` are the only allocations the model tracks (activation memory:
  graph inputs and parameters count as memory held before the step, i.e. 0).
* ``inputs`` fixes when a forward value can be freed and which ops produce gradients for it.
* ``saves`` is what autograd's saved-tensor hooks would keep: a matmul saves its input, a relu its
  own output, a view nothing. Views should be named by the op that owns their storage (the
  bridge resolves aliases), because the model counts bytes per op, not per storage.

:class:`Index` holds the per-op integer facts (readers, savers, last use, gradient windows, ...)
that both the simulator and the solver need; it is computed once per problem and cached.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Generic, Hashable, Iterable, Optional, Sequence, TypeVar, cast

__all__ = ["Op", "Problem", "Index", "Span", "Spans", "check_segments", "Key", "Memo"]

Span = tuple[int, int]
"""A segment as the solver sees it: a half-open ``(start, end)`` range of op positions."""
Spans = tuple[Span, ...]
"""A plan: sorted, non-overlapping spans over the op order."""


def _check_bytes(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int (got {value!r})")


def _check_names(what: str, value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a tuple of op names (got {value!r})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
    """One compute node of the model's graph, with the memory facts the simulator needs."""

    name: str
    """Unique name (the graph node's name)."""
    out_bytes: int
    """Bytes of fresh memory the output allocates (0 for views and aliases)."""
    cost: float
    """Time or FLOPs of one forward run; recomputing the op costs this again."""
    inputs: tuple[str, ...] = ()
    """Earlier ops it reads; names that are not ops are graph inputs (pre-existing memory)."""
    saves: tuple[str, ...] = ()
    """Earlier ops (or itself) whose outputs autograd keeps for this op's backward."""
    grad_bytes: int | None = None
    """Bytes of the gradient w.r.t. the output; ``None`` means ``out_bytes``, 0 = no gradient."""
    scratch_bytes: int = 0
    """Most bytes its kernel (forward or backward) allocates for itself while running, beyond its
    inputs and outputs; the reserve covers the largest."""
    hidden: bool = False
    """The op stands for tensors the *next* op's kernel makes and its backward keeps (a dropout
    mask): saving it, like saving one's own output, needs that kernel to have run."""
    saved_tensors: int = 0
    """Tensors autograd saves for its backward (weights included): inside a segment each passes
    through the checkpoint's saved-tensor hooks (:attr:`Problem.saved_overhead`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Op.name must be a non-empty string (got {self.name!r})")
        for field in ("inputs", "saves"):
            value = getattr(self, field)
            if isinstance(value, list):
                object.__setattr__(self, field, tuple(value))
            _check_names(f"Op {self.name!r}: {field}", getattr(self, field))
        _check_bytes(f"Op {self.name!r}: out_bytes", self.out_bytes)
        _check_bytes(f"Op {self.name!r}: scratch_bytes", self.scratch_bytes)
        _check_bytes(f"Op {self.name!r}: saved_tensors", self.saved_tensors)
        if self.grad_bytes is not None:
            _check_bytes(f"Op {self.name!r}: grad_bytes", self.grad_bytes)
        cost = self.cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 0 \
                or math.isinf(cost):
            raise ValueError(f"Op {self.name!r}: cost must be a finite number >= 0 (got {cost!r})")

    @property
    def gradient_bytes(self) -> int:
        """``grad_bytes`` with the default applied."""
        return self.out_bytes if self.grad_bytes is None else self.grad_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """A training step to plan: ops in topological order and the values the model returns."""

    ops: tuple[Op, ...]
    """Every compute node, in a topological order (the order forward runs them)."""
    outputs: tuple[str, ...]
    """Ops whose values the model returns; alive until backward starts, and seeded with grads."""
    segment_overhead: float = 0.0
    """Fixed cost of running one segment under checkpoint (hooks, RNG state, the extra call), in
    the units of ``Op.cost``: it makes the solver prefer fewer, larger segments at equal recompute.
    """
    early_stop: bool = False
    """The recompute of a segment stops at its last saved tensor, as torch's non-reentrant
    checkpoint does: ops after the last op that saves anything are not run again, and that op's
    own kernel runs only when it saves its output (or hidden tensors), since autograd saves an
    op's inputs before running it. A segment ending in ``linear -> add`` recomputes neither."""
    keep_overhead: float = 0.0
    """Fixed cost of keeping one op's output inside a segment (selective recompute's bookkeeping in
    forward and recompute), in the units of ``Op.cost``: keeping an op saves its cost less this,
    so ops cheaper than it are not worth keeping."""
    saved_overhead: float = 0.0
    """Fixed cost of each tensor an op inside a segment saves (:attr:`Op.saved_tensors`): the
    checkpoint's pack hook in forward and in the recompute and its unpack hook in backward, in
    Python, whether the op is recomputed, kept or offloaded. It makes a segment of many small ops
    dearer than its ops' own prices say."""
    offload_cost_per_byte: float | None = None
    """When set, a segment may instead keep its ops and move what they save to host memory and
    back, at this cost per byte; each segment then costs the cheaper of the two. Memory is the
    same either way: the segment's tensors are off the device between its forward and backward."""
    reserve_bytes: int = 0
    """Bytes every peak includes beyond the tensors the simulator counts: set aside for what it
    does not model (backward temporaries such as a gradient being scaled, kernel scratch). The
    bridge from the graph sets it to the largest single gradient or scratch buffer
    (:func:`fxckpt.cost.bridge.to_problem`). Every simulated peak and every budget the
    solvers meet count it, so nothing outside the solver adds or subtracts it."""

    def __post_init__(self) -> None:
        if isinstance(self.ops, list):
            object.__setattr__(self, "ops", tuple(self.ops))
        if isinstance(self.outputs, list):
            object.__setattr__(self, "outputs", tuple(self.outputs))
        if not isinstance(self.ops, tuple) or not all(isinstance(o, Op) for o in self.ops):
            raise ValueError(f"Problem.ops must be a tuple of Op (got {self.ops!r})")
        _check_names("Problem.outputs", self.outputs)
        _validate_order(self.ops, self.outputs)
        for field in ("segment_overhead", "keep_overhead", "saved_overhead",
                      "offload_cost_per_byte"):
            value = getattr(self, field)
            if value is None and field == "offload_cost_per_byte":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < math.inf:
                raise ValueError(f"Problem.{field} must be a finite number >= 0 (got {value!r})")
        _check_bytes("Problem.reserve_bytes", self.reserve_bytes)

    @functools.cached_property
    def index(self) -> "Index":
        """Integer facts derived from the ops, computed once (see :class:`Index`)."""
        return Index.build(self)

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """Names read or saved that are not ops: graph inputs, held before the step."""
        names = {op.name for op in self.ops}
        seen: dict[str, None] = {}
        for op in self.ops:
            for ref in op.inputs + op.saves:
                if ref not in names:
                    seen.setdefault(ref)
        return tuple(seen)


def _validate_order(ops: tuple[Op, ...], outputs: tuple[str, ...]) -> None:
    """Names are unique, references point backwards, outputs are ops."""
    position: dict[str, int] = {}
    for op in ops:
        if op.name in position:
            raise ValueError(f"op names must be unique (got {op.name!r} twice)")
        position[op.name] = len(position)
    for i, op in enumerate(ops):
        for ref in op.inputs:
            if position.get(ref, -1) >= i:
                raise ValueError(
                    f"op {op.name!r} (position {i}) reads {ref!r} (position {position[ref]}); "
                    "ops must be in topological order and may not read themselves")
        for ref in op.saves:
            if position.get(ref, -1) > i:
                raise ValueError(
                    f"op {op.name!r} (position {i}) saves the later op {ref!r} "
                    f"(position {position[ref]}); an op can only save itself or earlier ops")
    if len(set(outputs)) != len(outputs):
        raise ValueError(f"Problem.outputs has duplicates (got {outputs!r})")
    for name in outputs:
        if name not in position:
            raise ValueError(f"Problem.outputs names {name!r}, which is not an op")


def check_segments(segments: object, n: int) -> Spans:
    """Validate a plan for ``n`` ops; return it sorted as a tuple of int pairs."""
    try:
        pairs = [(s, e) for s, e in segments]  # type: ignore[attr-defined, misc]
    except (TypeError, ValueError):
        raise ValueError(f"segments must be (start, end) pairs (got {segments!r})") from None
    for s, e in pairs:
        if not (isinstance(s, int) and isinstance(e, int)) or isinstance(s, bool) \
                or isinstance(e, bool) or not 0 <= s < e <= n:
            raise ValueError(f"segment {(s, e)!r} must satisfy 0 <= start < end <= {n}")
    pairs.sort()
    for (s0, e0), (s1, e1) in zip(pairs, pairs[1:]):
        if s1 < e0:
            raise ValueError(f"segments {(s0, e0)} and {(s1, e1)} overlap")
    return tuple(pairs)


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Key(Generic[T]):
    """The name of one solver cache entry, typed: ``Key[Moves]("moves", space)`` holds a
    ``Moves``. Two keys are the same entry when their name and arguments are equal."""

    name: str
    args: Hashable = ()


class Memo:
    """The solver's caches on one problem's :class:`Index`: facts that depend only on the
    problem (profiles, move tables, block families, curves), each under a typed :class:`Key`."""

    def __init__(self) -> None:
        self._entries: dict[Key[Any], Any] = {}

    def get(self, key: Key[T], make: Callable[[], T]) -> T:
        """The entry ``key``, made by ``make()`` the first time it is asked for."""
        if key not in self._entries:
            self._entries[key] = make()
        return cast(T, self._entries[key])

    def find(self, key: Key[T]) -> Optional[T]:
        """The entry ``key`` when it was made, else ``None``."""
        return cast(Optional[T], self._entries.get(key))

    def put(self, key: Key[T], value: T) -> None:
        self._entries[key] = value


@dataclasses.dataclass(frozen=True)
class Index:
    """Per-op integer facts, by position ``i`` in ``Problem.ops`` (``n`` = number of ops).

    "Touch" = read as an input or kept as a saved tensor by a *later* op.
    """

    n: int
    out: tuple[int, ...]
    """Output bytes."""
    grad: tuple[int, ...]
    """Gradient bytes (0 when the gradient never exists: no readers and not an output)."""
    cost: tuple[float, ...]
    """Forward cost."""
    cum_cost: tuple[float, ...]
    """``cum_cost[i]`` = total cost of ops ``0..i-1`` (length ``n + 1``)."""
    touches: tuple[tuple[int, ...], ...]
    """Earlier ops each op reads or saves (sorted, unique)."""
    saves: tuple[tuple[int, ...], ...]
    """Ops each op saves (itself included when it saves its own output)."""
    touchers: tuple[tuple[int, ...], ...]
    """Later ops touching each op's output (sorted)."""
    savers: tuple[tuple[int, ...], ...]
    """Ops saving each op's output (sorted; may include the op itself)."""
    is_output: tuple[bool, ...]
    last_use: tuple[int, ...]
    """Last forward position reading the value (itself if none)."""
    last_alive: tuple[int, ...]
    """``last_use``, or ``n`` (backward start) for outputs."""
    first_saver: tuple[int, ...]
    """Smallest position saving the value, ``n`` if none."""
    grad_from: tuple[int, ...]
    """Position whose backward creates the gradient (``n`` = backward start, -1 = never)."""
    cum_saved: tuple[int, ...] = ()
    """``cum_saved[i]`` = output bytes of ops ``0..i-1`` that some op saves (what offload moves).
    """
    offload_per_byte: float | None = None
    """:attr:`Problem.offload_cost_per_byte`."""
    overhead: float = 0.0
    """:attr:`Problem.segment_overhead`."""
    cum_hooks: tuple[float, ...] = ()
    """``cum_hooks[i]``: :attr:`Problem.saved_overhead` for every tensor ops ``0..i-1`` save."""
    reserve: int = 0
    """:attr:`Problem.reserve_bytes`."""
    stops: tuple[int, ...] = ()
    """``stops[e]``, for a segment ending before ``e``: the position its recompute stops before
    (everything from there on is not run again), ignoring where it starts; ``e`` when the
    problem has no :attr:`Problem.early_stop`. A segment ``[s, e)`` recomputes ``s`` up to
    ``max(s, stops[e])``."""
    gain: tuple[float, ...] = ()
    """What keeping each op saves: its cost less :attr:`Problem.keep_overhead` (0 for an op that
    costs nothing, such as the synthetic op of a node's hidden saved tensors, kept with it)."""
    memo: Memo = dataclasses.field(default_factory=Memo, compare=False, hash=False, repr=False)
    """Solver caches that depend only on the problem (profiles, segment facts)."""

    @staticmethod
    def build(problem: Problem) -> "Index":
        ops = problem.ops
        n = len(ops)
        pos = {op.name: i for i, op in enumerate(ops)}
        reads = [sorted({pos[r] for r in op.inputs if r in pos}) for op in ops]
        saves = tuple(tuple(sorted({pos[s] for s in op.saves if s in pos})) for op in ops)
        touches = tuple(
            tuple(sorted(set(reads[i]) | {j for j in saves[i] if j != i})) for i in range(n))
        touchers, savers, max_reader = _reverse(n, reads, saves, touches)
        outputs = set(problem.outputs)
        is_output = tuple(op.name in outputs for op in ops)
        last_use = tuple(t[-1] if t else i for i, t in enumerate(touchers))
        grad_from = tuple(n if is_output[i] else max_reader[i] for i in range(n))
        stops = list(range(n + 1))
        if problem.early_stop:
            stop = 0  # after the last op that saves anything, or before it if it saves inputs only
            for i, op in enumerate(ops):
                stops[i] = stop
                if op.saves:
                    own = i in saves[i] or any(ops[j].hidden for j in saves[i])
                    stop = i + 1 if own else i
            stops[n] = stop
        cum, saved, hooks = [0.0], [0], [0.0]
        for i, op in enumerate(ops):
            cum.append(cum[-1] + float(op.cost))
            hooks.append(hooks[-1] + problem.saved_overhead * op.saved_tensors)
            saved.append(saved[-1] + (op.out_bytes if savers[i] else 0))
        return Index(
            n=n,
            out=tuple(op.out_bytes for op in ops),
            grad=tuple(op.gradient_bytes if grad_from[i] >= 0 else 0 for i, op in enumerate(ops)),
            cost=tuple(float(op.cost) for op in ops),
            cum_cost=tuple(cum),
            touches=touches,
            saves=saves,
            touchers=touchers,
            savers=savers,
            is_output=is_output,
            last_use=last_use,
            last_alive=tuple(n if is_output[i] else last_use[i] for i in range(n)),
            first_saver=tuple(s[0] if s else n for s in savers),
            grad_from=grad_from,
            cum_saved=tuple(saved),
            offload_per_byte=problem.offload_cost_per_byte,
            overhead=float(problem.segment_overhead),
            cum_hooks=tuple(hooks),
            reserve=problem.reserve_bytes,
            stops=tuple(stops),
            gain=tuple(float(op.cost) - problem.keep_overhead if op.cost > 0 else 0.0
                       for op in ops),
        )

    def recompute_end(self, start: int, end: int) -> int:
        """Ops ``start..recompute_end - 1`` of segment ``start..end-1`` run again in backward."""
        return max(start, self.stops[end])

    def kept_gain(self, segments: Sequence[tuple[int, int]], keep: Iterable[int]) -> float:
        """What keeping ``keep`` inside ``segments`` saves: the gain of each kept op that the
        recompute would have run (one past its segment's early stop saves nothing, and one in
        a segment that is offloaded instead of recomputed saves nothing either)."""
        runs = {i for s, e in segments if not self.segment_offloads(s, e)
                for i in range(s, self.recompute_end(s, e))}
        return sum(self.gain[j] for j in keep if j in runs)

    def segment_cost(self, start: int, end: int) -> float:
        """Cost of segment ``start..end-1``: recomputing it once, or offloading it if cheaper,
        with the segment's fixed overhead and its saved tensors' hooks."""
        recompute = self.cum_cost[self.recompute_end(start, end)] - self.cum_cost[start]
        if self.offload_per_byte is not None:
            recompute = min(
                recompute, self.offload_per_byte * (self.cum_saved[end] - self.cum_saved[start])
            )
        return recompute + self.overhead + self.hooks(start, end)

    def hooks(self, start: int, end: int) -> float:
        """:attr:`Problem.saved_overhead` for the tensors segment ``start..end-1`` saves."""
        return self.cum_hooks[end] - self.cum_hooks[start] if self.cum_hooks else 0.0

    def segment_offloads(self, start: int, end: int) -> bool:
        """True when offloading segment ``start..end-1`` costs less than recomputing it."""
        return (
            self.segment_cost(start, end) - self.overhead - self.hooks(start, end)
            < self.cum_cost[self.recompute_end(start, end)] - self.cum_cost[start]
        )


def _reverse(n: int, reads: list[list[int]], saves: tuple[tuple[int, ...], ...],
             touches: tuple[tuple[int, ...], ...]) -> tuple[
                 tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], list[int]]:
    """Per value: the ops touching it, the ops saving it (both sorted), its last reader."""
    touchers: list[list[int]] = [[] for _ in range(n)]
    savers: list[list[int]] = [[] for _ in range(n)]
    max_reader = [-1] * n
    for i in range(n):
        for j in touches[i]:
            touchers[j].append(i)
        for j in saves[i]:
            savers[j].append(i)
        for j in reads[i]:
            max_reader[j] = i
    return tuple(map(tuple, touchers)), tuple(map(tuple, savers)), max_reader

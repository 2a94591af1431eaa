"""Test helpers for the solver: an exhaustive oracle and seeded problem generators.

The oracle enumerates every segmentation of the op order (each op is outside, starts a segment,
or continues the current one: F(2n+1) plans for n ops, 514229 for 14) and scores each with the
public simulator, so it shares nothing with the solver's dynamic programme but the cost model.
"""

from __future__ import annotations

import random
from typing import Iterator, NamedTuple, Optional

from fxckpt.solver import Op, Problem, Spans, peak_bytes

__all__ = ["Scored", "all_plans", "exhaustive", "random_dag", "random_chain", "transformer_like"]


class Scored(NamedTuple):
    """One plan with its simulated peak and recompute cost."""

    peak: int
    cost: float
    segments: Spans


def _segmentations(n: int) -> Iterator[Spans]:
    def rec(i: int, open_start: int, acc: tuple[tuple[int, int], ...]) -> Iterator[Spans]:
        if i == n:
            yield acc + (((open_start, n),) if open_start >= 0 else ())
            return
        closed = acc + (((open_start, i),) if open_start >= 0 else ())
        yield from rec(i + 1, -1, closed)  # op i outside segments
        yield from rec(i + 1, i, closed)  # op i starts a segment
        if open_start >= 0:
            yield from rec(i + 1, open_start, acc)  # op i continues the segment

    return rec(0, -1, ())


def all_plans(problem: Problem) -> list[Scored]:
    """Every segmentation with its simulated peak and cost."""
    costs = [op.cost for op in problem.ops]
    return [Scored(peak_bytes(problem, segs), sum(sum(costs[s:e]) for s, e in segs), segs)
            for segs in _segmentations(len(problem.ops))]


def exhaustive(problem: Problem, budget: int,
               plans: Optional[list[Scored]] = None) -> Optional[Scored]:
    """Cheapest plan with peak <= budget (ties: lower peak), or None when none fits."""
    fitting = [p for p in (plans if plans is not None else all_plans(problem)) if p.peak <= budget]
    return min(fitting, key=lambda p: (p.cost, p.peak), default=None)


def _kind_op(rng: random.Random, name: str, reads: list[str]) -> Op:
    kind = rng.choice(["matmul", "matmul", "relu", "add", "view", "norm", "softmax"])
    size = rng.choice([1, 2, 3, 4, 6, 8]) * 64
    cost = float(rng.randint(1, 20))
    saves: tuple[str, ...] = ()
    if kind == "matmul":
        saves = tuple(reads)
        cost *= 4
    elif kind in ("relu", "softmax"):
        saves = (name,)
    elif kind == "norm":
        saves = tuple(reads[:1])
    elif kind == "view":
        size, cost = 0, 0.0
    grad = None if rng.random() > 0.1 else rng.choice([0, size // 2])
    return Op(name=name, out_bytes=size, cost=cost, inputs=tuple(reads), saves=saves,
              grad_bytes=grad)


def random_dag(n: int, seed: int, skip: float = 0.3) -> Problem:
    """A random DAG: mostly reads the previous op, sometimes a far one or the graph input."""
    rng = random.Random(seed)
    ops: list[Op] = []
    for i in range(n):
        reads = [f"op{i - 1}"] if i else ["x"]
        if i > 1 and rng.random() < skip:
            reads.append(f"op{rng.randrange(0, i - 1)}")
        elif rng.random() < 0.1:
            reads.append("x")
        ops.append(_kind_op(rng, f"op{i}", reads))
    sinks = {op.name for op in ops} - {r for op in ops for r in op.inputs}
    return Problem(ops=tuple(ops), outputs=tuple(sorted(sinks)))


def random_chain(n: int, seed: int) -> Problem:
    """A chain: each op reads only the previous one."""
    return random_dag(n, seed, skip=0.0)


def _layer(ops: list[Op], x: str, tag: str, width: int, seq: int, extra_views: int) -> str:
    """One pre-norm transformer block appended to ``ops``; returns the residual output's name."""
    d, scores = width * seq, 4 * seq * seq

    def add(name: str, out: int, cost: float, inputs: tuple[str, ...],
            saves: tuple[str, ...] = ()) -> str:
        ops.append(Op(name=f"{tag}.{name}", out_bytes=out, cost=cost,
                      inputs=tuple(f"{tag}.{i}" if i[0] != "@" else i[1:] for i in inputs),
                      saves=tuple(f"{tag}.{s}" if s[0] != "@" else s[1:] for s in saves)))
        for k in range(extra_views):
            ops.append(Op(name=f"{tag}.{name}.v{k}", out_bytes=0, cost=0.0,
                          inputs=(f"{tag}.{name}",)))
        return f"{tag}.{name}"

    mm = float(2 * seq * width * width)
    add("ln1", d, d, ("@" + x,), ("@" + x,))
    add("qkv", 3 * d, 3 * mm, ("ln1",), ("ln1",))
    add("scores", scores, 2 * seq * seq * width, ("qkv",), ("qkv",))
    add("softmax", scores, scores, ("scores",), ("softmax",))
    add("drop1", scores, scores, ("softmax",), ("drop1",))
    add("ctx", d, 2 * seq * seq * width, ("drop1", "qkv"), ("drop1", "qkv"))
    add("proj", d, mm, ("ctx",), ("ctx",))
    add("res1", d, d, ("proj", "@" + x))
    add("ln2", d, d, ("res1",), ("res1",))
    add("fc", 4 * d, 4 * mm, ("ln2",), ("ln2",))
    add("gelu", 4 * d, 4 * d, ("fc",), ("fc",))
    add("fc2", d, 4 * mm, ("gelu",), ("gelu",))
    return add("res2", d, d, ("fc2", "res1"))


def transformer_like(layers: int, extra_views: int = 9, width: int = 64, seq: int = 32) -> Problem:
    """A GPT-2-like graph: ``13 * (1 + extra_views)`` ops per layer plus an embedding and a loss
    (12 layers with the default 9 views per op: 1562 ops)."""
    ops: list[Op] = [Op(name="embed", out_bytes=width * seq, cost=float(width * seq),
                        inputs=("tokens",))]
    x = "embed"
    for k in range(layers):
        x = _layer(ops, x, f"h{k}", width, seq, extra_views)
    ops.append(Op(name="loss", out_bytes=4, cost=float(width * seq), inputs=(x,), saves=(x,)))
    return Problem(ops=tuple(ops), outputs=("loss",))


def chain4() -> Problem:
    """x -> a = mm(x) -> b = relu(a) -> c = mm(b) -> d = sum(c); gradients default to out_bytes."""
    return Problem(ops=(
        Op(name="a", out_bytes=100, cost=4.0, inputs=("x",), saves=("x",)),
        Op(name="b", out_bytes=100, cost=1.0, inputs=("a",), saves=("b",)),
        Op(name="c", out_bytes=50, cost=4.0, inputs=("b",), saves=("b",)),
        Op(name="d", out_bytes=10, cost=1.0, inputs=("c",)),
    ), outputs=("d",))

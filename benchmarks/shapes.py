"""Dynamic padding: what a new sequence length every step costs in capturing and planning.

    python -m benchmarks.shapes [--steps 200] [--lengths 50] [--out docs]

A small GPT-2 trains for ``steps`` steps, each at one of ``lengths`` distinct sequence lengths
drawn at random (the Hugging Face default, dynamic padding, looks like this). For each strategy it
reports how many captures and plans the loop made, the total time spent on them, and that total
against one plan (the cost of planning a single shape, measured in the same process). Without
shape-free capture, every new length would cost a capture: ``lengths`` times one plan.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

__all__ = ["measure", "growing", "render", "main"]

GROWING_TARGET = 0.10
"""Share of a growing-batch loop's time spent planning, at most (issue 33)."""

STRATEGIES: dict[str, dict[str, Any]] = {"depth=3": {"depth": 3}, "budget=0.5": {"budget": 0.5}}


def _model(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=128, n_head=4, n_positions=256, vocab_size=512,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


def measure(
    steps: int = 200, lengths: int = 50, layers: int = 4, batch: int = 4
) -> dict[str, Any]:
    """Run the loop for each strategy; returns plain numbers (see :func:`render`)."""
    import fxckpt

    rng = random.Random(0)
    pool = sorted(rng.sample(range(16, 129), lengths))
    schedule = [pool[i % lengths] for i in range(steps)]
    rng.shuffle(schedule)
    # warm-up, untimed: the first capture in a process also pays lazy imports and torch.export's
    # one-time set-up, which neither "one plan" nor the loop should be charged with
    fxckpt.inspect(fxckpt.transform(_model(layers), depth=layers, capture="graph")).plan_for(
        torch.randint(0, 512, (batch, pool[0])))
    rows = []
    for name, options in STRATEGIES.items():
        one = fxckpt.transform(_model(layers), **options, capture="graph")
        ids = torch.randint(0, 512, (batch, statistics.median_low(pool)))
        fxckpt.inspect(one).plan_for(ids)
        one_plan = fxckpt.inspect(one).planning_seconds
        tm = fxckpt.transform(_model(layers), **options, capture="graph")
        step_times = []
        for length in schedule:
            ids = torch.randint(0, 512, (batch, length))
            planned = fxckpt.inspect(tm).planning_seconds
            start = time.perf_counter()
            tm(ids, labels=ids).loss.backward()
            tm.zero_grad(set_to_none=True)
            step_times.append(
                time.perf_counter() - start - (fxckpt.inspect(tm).planning_seconds - planned)
            )
        info = fxckpt.inspect(tm)
        rows.append({"strategy": name, "captures": info.captures, "plans": info.plans_made,
                     "planning_s": info.planning_seconds, "one_plan_s": one_plan,
                     "step_s": statistics.median(step_times)})
    return {"steps": steps, "lengths": lengths, "layers": layers, "batch": batch,
            "range": (pool[0], pool[-1]), "rows": rows}


def growing(steps: int = 120, layers: int = 4, seq: int = 64, fraction: float = 0.5,
            capture: str = "graph") -> dict[str, Any]:
    """A batch that grows by one each step, from 1 to ``steps``, under a budget in bytes (half
    the unmodified step's verified peak at the largest batch): the share of the loop's time
    spent planning (plans are made at power-of-two buckets, :mod:`fxckpt.serve.plan_cache`),
    on one whole graph or through Dynamo (``capture``)."""
    import fxckpt

    largest = torch.randint(0, 512, (steps, seq))
    probe = fxckpt.transform(_model(layers), budget=0.99, example_inputs=(largest,),
        capture="graph")
    eager = fxckpt.inspect(probe).plan.eager_peak_bytes
    assert eager is not None
    budget = int(fraction * eager)
    del probe  # its captures and plans are the measurement's, not the loop's
    gc.collect()
    tm = fxckpt.transform(_model(layers), budget=budget, capture=capture)
    start = time.perf_counter()
    for batch in range(1, steps + 1):
        ids = torch.randint(0, 512, (batch, seq))
        tm(ids, labels=ids).loss.backward()
        tm.zero_grad(set_to_none=True)
    total = time.perf_counter() - start
    info = fxckpt.inspect(tm)
    return {"steps": steps, "layers": layers, "seq": seq, "budget": budget, "capture": capture,
            "graphs": len(info.graphs) or 1,
            "captures": info.captures, "plans": info.plans_made,
            "planning_s": info.planning_seconds, "total_s": total,
            "share": info.planning_seconds / total}


def render(result: dict[str, Any], machine: dict[str, Any]) -> str:
    from benchmarks.report import machine_line

    lines = [
        "# Dynamic padding: captures and plans over varying sequence lengths",
        "",
        "*Generated by `python -m benchmarks.shapes`; re-run it to refresh the numbers.*",
        "",
        f"GPT-2 ({result['layers']} layers, width 128, 4 heads, vocab 512) trains "
        f"{result['steps']} steps, batch {result['batch']}, each step at one of "
        f"{result['lengths']} distinct sequence lengths between {result['range'][0]} and "
        f"{result['range'][1]}, in random order (labels = inputs, the model's own loss). "
        "*One plan* is the time `fxckpt.inspect(tm).plan_for(ids)` takes for a single length "
        "(capture with `torch.export` plus one plan), measured in the same process after an "
        "untimed warm-up capture. "
        "A capture per shape would cost about *lengths × one plan*.",
        "",
        "| strategy | captures | plans | planning in the loop | one plan | loop / one plan | "
        "capture per shape (est.) | median step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['captures']} | {r['plans']} | {r['planning_s']:.2f} s | "
            f"{r['one_plan_s']:.2f} s | {r['planning_s'] / r['one_plan_s']:.2f}x | "
            f"{result['lengths'] * r['one_plan_s']:.0f} s | {r['step_s'] * 1e3:.0f} ms |"
        )
    lines += [
        "",
        "Under a budget each new length larger than every length planned so far is planned "
        "(the plan depends on sizes); a smaller one reuses the plan of the smallest larger "
        "length, whose peak there is lower still. With `depth=`, `every=` and `force=` the plan "
        "does not depend on sizes: "
        "one capture, one plan.",
        "",
    ]
    rows = result.get("growing") or []
    if rows:
        g = rows[0]
        lines += [
            "## A growing batch",
            "",
            f"The same GPT-2 ({g['layers']} layers) trains {g['steps']} steps at sequence length "
            f"{g['seq']}, the batch growing by one each step from 1 to {g['steps']}, under a "
            f"budget of {g['budget'] / 2 ** 20:.1f} MiB (half the unmodified step's verified peak "
            "at the largest batch), on one whole graph (`capture=\"graph\"`) and through Dynamo "
            "(the default), whose plans follow the same size policy. The first call is planned: "
            "its plan has no segment (the unmodified step, verified on the graph, fits the "
            "budget). As the batch grows the latest plan is checked at power-of-two sizes, as "
            "far ahead as the peaks seen say it holds; the first size it would not fit at is "
            "planned at its grown dimensions rounded up to the next power of two, and a larger "
            "call is served by the latest plan where it verifies under the budget, else planned "
            "at the next bucket. Planning counts the captures (Dynamo: the graphs it handed "
            "over), the plans and every check; Dynamo's own tracing is not in it.",
            "",
            "| capture | graphs a step | captures | plans | planning | loop | planning share "
            "| target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for g in rows:
            ok = "PASS" if g["share"] <= GROWING_TARGET else "FAIL"
            lines.append(
                f"| {g['capture']} | {g['graphs']} | {g['captures']} | {g['plans']} "
                f"| {g['planning_s']:.2f} s "
                f"| {g['total_s']:.2f} s | {g['share']:.1%} | <= {GROWING_TARGET:.0%}: {ok} |")
        lines.append("")
    lines += [
        machine_line(machine),
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.report import machine_info

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shapes", description=__doc__.splitlines()[0]
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lengths", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs"))
    args = p.parse_args(argv)
    if not 1 <= args.lengths <= 113 or args.steps < 1:
        p.error(
            f"--lengths must be in 1..113 and --steps positive (got {args.lengths}, {args.steps})"
        )
    torch.set_num_threads(args.threads)
    result = measure(args.steps, args.lengths, args.layers)
    result["growing"] = [growing(layers=args.layers, capture=c) for c in ("graph", "auto")]
    text = render(result, machine_info())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shapes.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Re-measure the cost model's tuned constants on this machine, beside the values in the code.

    python -m benchmarks.calibrate [--repeats 30] [--threads 1] [--out docs]

The solver weighs recompute in FLOP-equivalents (:mod:`fxckpt.cost.prices`,
:mod:`fxckpt.cost.bridge`): a matmul costs its FLOPs, every other call a price per byte it
writes plus a price per call, and a checkpointed segment and a kept node a fixed overhead. Those
constants were measured once, on the benchmark machine; this script measures them again where it
runs, in the same units, and writes ``calibration.md``:

* the **matmul rate** (a 1024 x 1024 fp32 matmul), the unit every other price is taken in;
* the **call price**: a call on a one-element tensor;
* the **price per byte written** of the table's ops (read, for reductions), on 1 MiB float32
  tensors read from memory, as plans for a CPU measure them
  (:class:`fxckpt.cost.cpu_table.MeasuredTable`: the fastest of 3 passes, rounded to a
  quarter power of two);
* the **segment overhead**: a step of 32 tiny ``Linear`` + ``Tanh`` blocks, each a segment
  (``every=1``), against the unmodified step, per segment;
* the **keep overhead**: the same plan with one kept node per segment, against it, per keep;
* the **saved-tensor price**: a step of 160 ``sin`` calls on 64 numbers in one segment, against
  the unmodified step, per call, less the call itself (each ``sin`` saves one tensor).

Medians of ``repeats`` runs after a warm-up. A ratio far from 1 says the constant is stale for
this machine; the constants are estimates for ranking plans, and a plan's peak never depends on
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from fxckpt.cost import cpu_table
from fxckpt.cost.cpu_table import matmul_rate
from fxckpt.cost.prices import EVEN, TABLE
from fxckpt.measure import time_step

__all__ = ["Row", "matmul_rate", "measure", "render", "main", "OPS"]



@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    """The constant (``CPU_PRICES['gelu']``, ``SEGMENT_COST``, ...)."""
    code: float
    """Its value in the code, FLOP-equivalents."""
    measured: float
    """Measured here, FLOP-equivalents."""
    how: str


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return time_step(fn, repeats=repeats, warmup=1)


OPS = cpu_table.OPS
"""The ops whose price per byte is measured (:mod:`fxckpt.cost.cpu_table`'s calls)."""


def _label(key: str) -> str:
    """The constant in :mod:`fxckpt.cost.prices` that prices ``key``."""
    if key == "random":
        return "RANDOM_PRICE"
    if key == EVEN:  # the same constant: the table has one price for a draw
        return "RANDOM_PRICE (p = 0.5)"
    if key == "gelu_tanh":
        return "GELU_TANH_PRICE"
    if key.startswith("read:"):
        return f"REDUCTIONS[{key[5:]!r}]"
    return f"CPU_PRICES[{key!r}]"


def _mlp(layers: int = 32, width: int = 8) -> torch.nn.Sequential:
    """``Linear`` + ``Tanh`` blocks: a segment over one block frees the ``Linear``'s output."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(layers)
                                 for m in (torch.nn.Linear(width, width), torch.nn.Tanh())))


def _step_seconds(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    def step() -> None:
        module(x).sum().backward()
        module.zero_grad(set_to_none=True)
    return _median_seconds(step, repeats)


def _overheads(rate: float, repeats: int) -> tuple[Row, Row]:
    """Per segment and per kept node, in FLOP-equivalents at ``rate``."""
    import fxckpt
    from fxckpt.cost.bridge import KEEP_COST, SEGMENT_COST

    layers = 32
    x = torch.randn(2, 8)
    eager = _step_seconds(_mlp(layers), x, repeats)
    every = fxckpt.transform(_mlp(layers), every=1, example_inputs=(x,))
    plan = fxckpt.inspect(every).plan
    segmented = _step_seconds(every, x, repeats)
    kept_plan = dataclasses.replace(plan, segments=tuple(
        dataclasses.replace(seg, keeps=seg.nodes[:1]) for seg in plan.segments))
    kept = fxckpt.transform(_mlp(layers), plan=kept_plan, example_inputs=(x,))
    keeping = _step_seconds(kept, x, repeats)
    n = len(plan.segments)
    return (
        Row("SEGMENT_COST", SEGMENT_COST, (segmented - eager) / n * rate,
            f"{n} one-block segments (every=1) against the unmodified step, per segment"),
        Row("KEEP_COST", KEEP_COST, (keeping - segmented) / n * rate,
            f"one kept node in each of the {n} segments against none, per keep"),
    )


class _Sines(torch.nn.Module):
    """``calls`` ``sin`` calls in a row: each saves its input for backward."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls
        self.scale = torch.nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for _ in range(self.calls):
            x = torch.sin(x)
        return x


def _saved(rate: float, repeats: int) -> Row:
    """Per saved tensor, in FLOP-equivalents at ``rate``."""
    import fxckpt
    from fxckpt.cost.bridge import SAVED_COST

    calls, x = 160, torch.randn(64)
    eager = _step_seconds(_Sines(calls), x, repeats)
    one = fxckpt.transform(_Sines(calls), every=10 * calls, example_inputs=(x,))
    segmented = _step_seconds(one, x, repeats)
    call = _median_seconds(lambda: torch.sin(x), repeats)
    return Row("SAVED_COST", SAVED_COST, max(0.0, (segmented - eager) / calls - call) * rate,
               f"{calls} sin calls in one segment against none, per call, less the call")


def measure(repeats: int = 30) -> dict[str, Any]:
    """The matmul rate (FLOP/s) and a :class:`Row` per constant."""
    rate = matmul_rate()
    table = cpu_table.MeasuredTable(rate, cpu_table.call_seconds() * rate)
    rows = [Row("CALL_PRICE", TABLE.call, table.call, "a call on a one-element tensor")]
    for key in OPS:
        what = "read" if key.startswith("read:") else "written"
        draw = {"random": " (bernoulli_ at p = 1)", EVEN: " (bernoulli_ at p = 0.5)"}
        rows.append(Row(_label(key), TABLE.price(key), table.price(key),
                        f"{key.removeprefix('read:')}{draw.get(key, '')}, per byte {what} "
                        "(1 MiB, from memory)"))
    rows += [*_overheads(rate, repeats), _saved(rate, repeats)]
    return {"rate": rate, "rows": [dataclasses.asdict(r) for r in rows], "repeats": repeats}


def render(result: dict[str, Any], machine: Optional[dict[str, Any]] = None) -> str:
    lines = [
        "# Calibration: the cost model's constants, measured again",
        "",
        "*Generated by `python -m benchmarks.calibrate`; re-run it on the machine you plan "
        "for.*",
        "",
        "The solver prices recompute in FLOP-equivalents: FLOPs at the matmul rate measured "
        f"here ({result['rate'] / 1e9:.1f} GFLOP/s, a 1024 x 1024 fp32 matmul), bytes written "
        "at a price per byte, and a fixed price per call, per checkpointed segment and per kept "
        "node (`fxckpt/cost/prices.py`: the table, measured on the project's benchmark "
        "machine). Each row: the value in the table, the value measured here (prices per call "
        "and byte as a plan for this CPU measures them, `fxckpt/cost/cpu_table.py`; the "
        f"overheads: medians of {result['repeats']} steps), and their ratio. Prices only rank "
        "plans by time; a plan's peak never depends on them.",
        "",
        "| constant | in the code | measured here | measured / code | how |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = r["measured"] / r["code"] if r["code"] else float("nan")
        lines.append(f"| `{r['name']}` | {r['code']:.3g} | {r['measured']:.3g} | "
                     f"{ratio:.2f} | {r['how']} |")
    lines.append("")
    if machine is not None:
        from benchmarks.report import machine_line

        lines += [machine_line(machine), ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.report import machine_info

    p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate",
                                description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs"))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be positive (got {args.repeats})")
    torch.set_num_threads(args.threads)
    text = render(measure(args.repeats), machine_info())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Re-measure the cost model's tuned constants on this machine, beside the values in the code.

    python -m benchmarks.calibrate [--repeats 30] [--threads 1] [--out docs]

The solver weighs recompute in FLOP-equivalents (:mod:`fxckpt.cost.prices`,
:mod:`fxckpt.cost.bridge`): a matmul costs its FLOPs, every other call a price per byte it
writes plus a price per call, and a checkpointed segment and a kept node a fixed overhead. Those
constants were measured once, on the benchmark machine; this script measures them again where it
runs, in the same units, and writes ``calibration.md``:

* the **matmul rate** (a 1024 x 1024 fp32 matmul), the unit every other price is taken in;
* the **call price**: a call on a one-element tensor;
* the **price per byte written** of the table's ops, on 1 MiB float32 tensors read from memory,
  not from the cache (:data:`COLD`);
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
import torch.nn.functional as F

from fxckpt.measure import time_step

__all__ = ["Row", "matmul_rate", "measure", "render", "main", "OPS"]

MiB = 1 << 20


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


def _ops() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]]:
    """Op name in the price table -> (a call on a positive float32 tensor, its aten name)."""
    return {
        "mul": (lambda x: x * 1.5, "mul"), "add": (lambda x: x + 1.5, "add"),
        "relu": (torch.relu, "relu"), "clone": (torch.clone, "clone"),
        "sigmoid": (torch.sigmoid, "sigmoid"), "silu": (F.silu, "silu"),
        "rsqrt": (torch.rsqrt, "rsqrt"), "gelu": (F.gelu, "gelu"),
        "gelu (tanh)": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
        "softmax": (lambda x: torch.softmax(x, -1), "_softmax"),
        "log_softmax": (lambda x: torch.log_softmax(x, -1), "_log_softmax"),
        "layer_norm": (lambda x: F.layer_norm(x, x.shape[-1:]), "native_layer_norm"),
        "exp": (torch.exp, "exp"), "log": (torch.log, "log"),
        "tanh": (torch.tanh, "tanh"),
        "bernoulli_": (lambda x: x.bernoulli_(0.5), "bernoulli"),
    }


OPS = tuple(_ops())
"""The ops whose price per byte is measured."""


COLD = 64
"""1 MiB inputs an op's price is measured over, in turn: 64 MiB, more than a server CPU's cache
holds for one core, so each call reads its input from memory as a model's op does (a price
measured on one cached input was 2-4x too low against the steps of ``benchmarks.step_time``)."""


def _cold(fn: Callable[[torch.Tensor], torch.Tensor], xs: list[torch.Tensor]
          ) -> Callable[[], object]:
    """One call of ``fn`` on each of ``xs`` in turn."""
    def run() -> None:
        for x in xs:
            fn(x)
    return run


def _code_price(aten: str) -> float:
    from fxckpt.cost import prices

    if aten == "gelu_tanh":
        return prices.GELU_TANH_PRICE
    if aten == "bernoulli":
        return prices.RANDOM_PRICE
    return prices.CPU_PRICES.get(aten, prices.DEFAULT_PRICE)


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


def matmul_rate(repeats: int = 30) -> float:
    """FLOP/s of a 1024 x 1024 fp32 matmul here: the unit every CPU price is taken in."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024 ** 3 / _median_seconds(lambda: a @ b, repeats)


def measure(repeats: int = 30) -> dict[str, Any]:
    """The matmul rate (FLOP/s) and a :class:`Row` per constant."""
    from fxckpt.cost.prices import CALL_PRICE

    rate = matmul_rate(repeats)
    one = torch.ones(1)
    rows = [Row("CALL_PRICE", CALL_PRICE, _median_seconds(lambda: one + one, repeats) * rate,
                "a call on a one-element tensor")]
    for name, (fn, aten) in _ops().items():
        xs = [torch.rand(256, 1024) + 0.5 for _ in range(COLD)]  # 1 MiB each, positive
        seconds = _median_seconds(_cold(fn, xs), repeats) / COLD
        price = max(0.0, seconds * rate - CALL_PRICE) / MiB
        label = "RANDOM_PRICE" if aten == "bernoulli" else (
            "GELU_TANH_PRICE" if aten == "gelu_tanh" else f"CPU_PRICES[{aten!r}]")
        rows.append(Row(label, _code_price(aten), price,
                        f"{name}, per byte written (1 MiB, from memory)"))
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
        "node (`fxckpt/cost/prices.py`, `fxckpt/cost/bridge.py`). Each row: the value "
        f"in the code, the value measured here (median of {result['repeats']} runs), and their "
        "ratio. Prices only rank plans by time; a plan's peak never depends on them.",
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

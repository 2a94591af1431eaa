"""The GPU bench: fxckpt against hand-placed checkpointing and torch.compile's budget, on a GPU.

    python -m benchmarks.gpu --out OUTDIR [--device cuda|cpu] [--quick] [--repeats 5]

Models sized for one H100 in bf16: a Llama-style model of about 1B parameters (grouped-query
attention, RoPE, SwiGLU; sequence 2048, batch 4) and GPT-2 medium. ``--quick`` runs them with
a quarter of the layers and half the sequence, so that the whole GPU check (the CUDA tier of the
tests, then this) fits in eight minutes on one H100; ``--device cpu --quick`` runs the bench's
tiny sizes on the CPU, which CI does to check the script end to end.

Every method is prepared as :mod:`benchmarks.methods` prepares it, on a fresh copy of the
model, in this process. Per method: the peak memory of a training step above what was held
before it (``torch.cuda.max_memory_allocated``, and the reserved peak; on the CPU the live-tensor
tracker's), and the step time paired by turns with the unmodified model
(:func:`fxckpt.measure.time_by_turns`, each timed step after an untimed one, CUDA synchronised).
fxckpt's rows also give the peak the plan states. Methods: unmodified, per-block
``torch.utils.checkpoint``, torchtitan's op policy and Megatron's selective recompute
(:mod:`benchmarks.sac`), ``torch.compile`` with ``activation_memory_budget=0.5``, fxckpt at
0.5 and 0.66 of the unmodified peak and at each peer's measured peak, fxckpt moving every
saved tensor to pinned host memory (``offload=True``), whose copies are timed against the step,
and fxckpt at 0.5 with ``offload="auto"`` (copies beside the compute, within what the host link
moves during the forward: :mod:`fxckpt.planning.overlap`), checked against fxckpt at 0.5.
A budget plan refines its prices after its first steps (:mod:`fxckpt.serve.refine`): its rows
also check the unmodified step that refinement predicts against the unmodified step timed.

The targets of issue 32 are checked beside the numbers (:func:`targets`). ``OUTDIR`` receives
``gpu_bench.json`` and ``gpu_bench.md``; the last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["SIZES", "measure", "targets", "render", "main"]

SIZES: dict[str, dict[str, dict[str, int]]] = {
    "llama": {
        "full": {"layers": 16, "width": 2048, "heads": 32, "kv_heads": 8, "ffn": 5632,
                 "vocab": 32000, "batch": 4, "seq": 2048},
        "quick": {"layers": 4, "width": 2048, "heads": 32, "kv_heads": 8, "ffn": 5632,
                  "vocab": 32000, "batch": 4, "seq": 1024},
    },
    "gpt2": {
        "full": {"layers": 24, "width": 1024, "heads": 16, "vocab": 50257, "batch": 4,
                 "seq": 1024},
        "quick": {"layers": 6, "width": 1024, "heads": 16, "vocab": 50257, "batch": 4,
                  "seq": 512},
    },
}
"""Model sizes on a GPU (``full``, ``quick``); on the CPU the bench's own quick sizes."""

PEERS = ("checkpoint_per_block", "sac_ops", "sac_megatron", "compile")
FRACTIONS = (0.5, 0.66)


@dataclasses.dataclass
class Row:
    model: str
    method: str
    peak_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None
    stated_bytes: Optional[int] = None
    seconds: Optional[float] = None
    unmodified_seconds: Optional[float] = None
    budget: Optional[float] = None
    """A fraction of the unmodified peak (``float``), or bytes (``int``, a peer's peak)."""
    budget_bytes: Optional[int] = None
    """The budget in bytes as the plan resolved it."""
    copy_seconds: Optional[float] = None
    tokens: int = 0
    """Tokens a step trains on (batch x sequence)."""
    error: Optional[str] = None
    predicted_unmodified: Optional[float] = None
    """For a budget plan that refined its prices: the unmodified step predicted from its first
    timed steps (:meth:`fxckpt.serve.refine.Refinement.base_seconds`)."""

    @property
    def ratio(self) -> Optional[float]:
        """Step time against the unmodified model's, paired by turns."""
        if self.seconds is None or self.unmodified_seconds is None:
            return None
        return self.seconds / self.unmodified_seconds


def _build(name: str, device: torch.device, quick: bool) -> tuple[Any, tuple, Any, Any]:
    from benchmarks.models import spec_for

    spec = spec_for(name)
    sizes = SIZES[name]["quick" if quick else "full"] if device.type == "cuda" else spec.quick
    torch.manual_seed(0)
    model, inputs, loss = spec.build(sizes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype)
    inputs = tuple(t.to(device) for t in inputs)
    ids = inputs[0]

    def step_loss(out: Any) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()) \
            if hasattr(out, "logits") else logits.float().square().mean()

    return model, inputs, step_loss, spec


def _peak(step: Callable[[], None], device: torch.device) -> tuple[int, Optional[int]]:
    """Bytes a step allocates at most beyond what was held before it (and reserved, on CUDA)."""
    step()  # warm-up: gradients and caches are allocated once
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before,
                torch.cuda.max_memory_reserved(device) - reserved)
    from fxckpt.measure.tracker import LiveTensorTracker

    with LiveTensorTracker() as tracker:
        step()
    return tracker.peak_bytes, None


def _timed(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    def run() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def _method(name: str, method: str, budget: Optional[float], device: torch.device, quick: bool,
            repeats: int, baseline: Callable[[], None]) -> Row:
    from benchmarks.methods import NotApplicable, prepare
    from fxckpt.measure import time_by_turns, training_step

    row = Row(name, method, budget=budget)
    model, inputs, loss, spec = _build(name, device, quick)
    row.tokens = inputs[0].numel()
    try:
        if method == "fxckpt_offload":
            import fxckpt

            run: Any = fxckpt.transform(model, offload=True, offload_device="cpu",
                                        example_inputs=inputs)
            facts: dict[str, Any] = {}
        elif method == "fxckpt_offload_auto":
            import fxckpt

            run = fxckpt.transform(model, budget=budget, offload="auto", offload_device="cpu",
                                   example_inputs=inputs)
            plan = fxckpt.inspect(run).plan
            facts = {"plan_peak": plan.peak_bytes, "budget_bytes": plan.budget_bytes}
        else:
            run, facts = prepare(method, model, inputs, spec, budget, loss=loss,
                                 time_solver=False)
        step = training_step(run, inputs, loss)
        row.peak_bytes, row.reserved_bytes = _peak(step, device)
        row.stated_bytes = facts.get("plan_peak")
        row.budget_bytes = facts.get("budget_bytes")
        times = time_by_turns({"method": _timed(step, device), "unmodified": baseline},
                              repeats=repeats)
        row.seconds = statistics.median(times["method"])
        row.unmodified_seconds = statistics.median(times["unmodified"])
        if method == "fxckpt":
            import fxckpt

            refinement = fxckpt.inspect(run).refinement
            row.predicted_unmodified = None if refinement is None else refinement.base_seconds()
        if method in ("fxckpt_offload", "fxckpt_offload_auto"):
            stats = fxckpt.inspect(run).offload_stats
            row.copy_seconds = 2 * stats.bytes_moved / _link_bandwidth(device)
    except NotApplicable as e:
        row.error = f"not applicable: {e}"
    except Exception as e:  # a failing method is a row of the report, not the end of the run
        row.error = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _link_bandwidth(device: torch.device) -> float:
    from fxckpt.cost.rates import measure_rates

    return measure_rates(device, "cpu")[1]


def measure(device: str = "cuda", quick: bool = False, repeats: int = 5,
            models: Sequence[str] = ("llama", "gpt2"),
            methods: Sequence[str] = PEERS) -> list[Row]:
    """Every row of the report, for ``models`` and the peer ``methods``."""
    from fxckpt.measure import training_step

    dev = torch.device(device)
    rows: list[Row] = []
    for name in models:
        model, inputs, loss, _ = _build(name, dev, quick)
        baseline_step = training_step(model, inputs, loss)
        base = Row(name, "unmodified", tokens=inputs[0].numel())
        base.peak_bytes, base.reserved_bytes = _peak(baseline_step, dev)
        baseline = _timed(baseline_step, dev)
        rows.append(base)
        plan = [(m, 0.5 if m == "compile" else None) for m in methods]
        plan += [("fxckpt", f) for f in FRACTIONS]
        for method, budget in plan:
            rows.append(_method(name, method, budget, dev, quick, repeats, baseline))
        for peer in [r for r in rows if r.model == name and r.method in methods and r.peak_bytes]:
            row = _method(name, "fxckpt", int(peer.peak_bytes or 0), dev, quick, repeats,
                          baseline)
            row.method = f"fxckpt @{peer.method}"
            rows.append(row)
        if dev.type == "cuda":
            rows.append(_method(name, "fxckpt_offload", None, dev, quick, repeats, baseline))
            rows.append(_method(name, "fxckpt_offload_auto", FRACTIONS[0], dev, quick, repeats,
                                baseline))
        for r in rows:
            if r.model == name and r.method == "unmodified":
                r.seconds = r.unmodified_seconds = statistics.median(
                    [x.unmodified_seconds for x in rows
                     if x.model == name and x.unmodified_seconds] or [float("nan")])
        del model, baseline_step
        gc.collect()
    return rows


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    passed: Optional[bool]
    """``None``: not measured (an error row, or not on this device)."""
    detail: str


def targets(rows: list[Row]) -> list[Check]:
    """Issue 32's targets, each with its numbers."""
    checks = []
    by = {(r.model, r.method): r for r in rows}
    for r in rows:
        if r.error is not None or not r.method.startswith("fxckpt") or r.peak_bytes is None:
            continue
        budget = r.budget_bytes
        if budget:
            checks.append(Check(f"budget held: {r.model} {r.method} b={r.budget}",
                                r.peak_bytes <= 1.02 * budget,
                                f"measured {r.peak_bytes / 2**20:.1f} MiB vs 1.02 x "
                                f"{budget / 2**20:.1f} MiB"))
        if r.stated_bytes:
            error = r.stated_bytes / r.peak_bytes - 1
            checks.append(Check(f"plan peak within 5%: {r.model} {r.method}", abs(error) <= 0.05,
                                f"plan {r.stated_bytes / 2**20:.1f} MiB vs measured "
                                f"{r.peak_bytes / 2**20:.1f} MiB ({error:+.1%})"))
        if r.method.startswith("fxckpt @"):
            peer = by.get((r.model, r.method.removeprefix("fxckpt @")))
            if peer is not None and peer.seconds and r.seconds and peer.peak_bytes:
                faster = r.seconds / peer.seconds
                checks.append(Check(
                    f"faster at the peer's memory: {r.model} {r.method}",
                    faster <= 0.95 and r.peak_bytes <= 1.05 * peer.peak_bytes,
                    f"time {faster:.3f}x the peer's, memory "
                    f"{r.peak_bytes / peer.peak_bytes:.3f}x"))
        if r.model == "llama" and r.budget == 0.5 and r.ratio is not None:
            which = "" if r.method == "fxckpt" else f" ({r.method})"
            checks.append(Check(f"llama at 0.5 within 1.05x unmodified time{which}",
                                r.ratio <= 1.05, f"{r.ratio:.3f}x"))
        same = next((x.ratio for x in rows if x.model == r.model and x.method == "fxckpt"
                     and x.budget == r.budget and x.ratio is not None), None)
        if r.method == "fxckpt_offload_auto" and same is not None and r.ratio is not None:
            # copies beside the compute (planning/overlap.py): offloading at the same budget
            # must not be slower than only recomputing, as the plan predicts
            checks.append(Check(f"offload='auto' no slower than recompute: {r.model} "
                                f"b={r.budget}", r.ratio <= same * 1.02,
                                f"{r.ratio:.3f}x unmodified against {same:.3f}x"))
        if r.predicted_unmodified and r.unmodified_seconds:
            error = r.predicted_unmodified / r.unmodified_seconds - 1
            checks.append(Check(f"unmodified step predicted within 10%: {r.model} {r.method}"
                                f" b={_budget(r.budget)}", abs(error) <= 0.10,
                                f"{r.predicted_unmodified * 1e3:.1f} ms from the plan's first "
                                f"steps vs {r.unmodified_seconds * 1e3:.1f} ms ({error:+.1%})"))
        if r.method == "fxckpt_offload" and r.copy_seconds and r.ratio is not None:
            exposed = max(0.0, (r.seconds or 0) - (r.unmodified_seconds or 0))
            hidden = 1 - min(1.0, exposed / r.copy_seconds)
            checks.append(Check(f"offload hides 80% of its copies: {r.model}", hidden >= 0.8,
                                f"{hidden:.0%} of {r.copy_seconds * 1e3:.1f} ms hidden"))
    return checks


def _budget(budget: Optional[float]) -> str:
    if budget is None:
        return "—"
    return f"{budget:g}" if isinstance(budget, float) else f"{budget / 2**20:.1f} MiB"


def _mib(n: Optional[int]) -> str:
    return "—" if n is None else f"{n / 2**20:.1f}"


def render(rows: list[Row], checks: list[Check], device: str, machine: dict[str, Any]) -> str:
    from benchmarks.report import machine_line

    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() \
        else "CPU"
    lines = [
        f"# GPU bench on {name}, {time.strftime('%Y-%m-%d')}",
        "",
        "*Generated by `python -m benchmarks.gpu` (see its docstring for the protocol).*",
        "",
        "| model | method | budget | peak MiB | reserved MiB | plan MiB | step | tokens/s "
        "| vs unmodified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = "—" if r.seconds is None else f"{r.seconds * 1e3:.1f} ms"
        rate = "—" if not (r.seconds and r.tokens) else f"{r.tokens / r.seconds:,.0f}"
        ratio = "—" if r.ratio is None else f"{r.ratio:.3f}x"
        budget = _budget(r.budget)
        cells = [r.model, r.method, budget, _mib(r.peak_bytes), _mib(r.reserved_bytes),
                 _mib(r.stated_bytes), step, rate, ratio]
        if r.error:
            cells = [r.model, r.method, budget, r.error[:120], "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets", ""]
    lines += [f"- **{'PASS' if c.passed else 'FAIL' if c.passed is False else 'n/a'}** "
              f"{c.name}: {c.detail}" for c in checks]
    lines += ["", machine_line(machine), ""]
    return "\n".join(lines)


def summary(rows: list[Row], checks: list[Check], seconds: float) -> str:
    passed = sum(c.passed is True for c in checks)
    failed = sum(c.passed is False for c in checks)
    errors = sum(r.error is not None and not r.error.startswith("not applicable") for r in rows)
    return (f"gpu bench: {len(rows)} rows, {errors} errors, targets {passed} PASS / {failed} FAIL,"
            f" {seconds:.0f} s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.report import machine_info
    from fxckpt.cli import positive_int

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--models", default="llama,gpt2")
    p.add_argument("--methods", default=",".join(PEERS))
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (use --device cpu --quick)")
    start = time.perf_counter()
    rows = measure(args.device, args.quick, args.repeats, args.models.split(","),
                   [m for m in args.methods.split(",") if m])
    checks = targets(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(
        {"device": args.device, "quick": args.quick, "rows": [dataclasses.asdict(r) for r in rows],
         "targets": [dataclasses.asdict(c) for c in checks], "machine": machine_info()},
        indent=1))
    (args.out / "gpu_bench.md").write_text(render(rows, checks, args.device, machine_info()))
    print(summary(rows, checks, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
